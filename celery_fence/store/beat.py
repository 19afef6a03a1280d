"""The beat scheduler's ticks: the last scheduled time each entry fired, in ``fence_beat_ticks``
(the statements are in :mod:`.sql`). Composed into the job store as ``store.beat_ticks``; read and
moved forward by :mod:`celery_fence.beat`'s scheduler, listed by ``celery fence beat ls``.

A row only moves forward: :meth:`BeatTicks.advance` is a conditional upsert, so a replica that
is behind (its clock, or a send that took long) never moves an entry back to an older tick.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_fence.schema import as_utc, beat_ticks, utcnow
from celery_fence.store import sql

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store


#: The first part of every beat tick's fence key.
TICK_PREFIX = "beat"


def tick_key(entry: str, scheduled: dt.datetime) -> str:
    """The fence key of ``entry``'s tick scheduled at ``scheduled``:
    ``beat:<entry>:<YYYY-MM-DDTHH:MM:SSZ>`` (UTC, second precision)."""
    when = as_utc(scheduled).replace(microsecond=0)
    return f"{TICK_PREFIX}:{entry}:{when.strftime('%Y-%m-%dT%H:%M:%SZ')}"


@dataclass(frozen=True)
class BeatTick:
    """One row of ``fence_beat_ticks``: an entry's last fired tick (its scheduled time, UTC)."""

    entry: str
    last_scheduled: dt.datetime
    updated_at: dt.datetime

    @property
    def key(self) -> str:
        """The fence key of that tick's job."""
        return tick_key(self.entry, self.last_scheduled)


class BeatTicks:
    """The rows of ``fence_beat_ticks``, ``store.beat_ticks`` of a
    :class:`~celery_fence.store.Store`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def table_exists(self) -> bool:
        """Whether the database has ``fence_beat_ticks`` (``celery fence init-db`` adds it)."""
        return bool(sa.inspect(self._store.engine).has_table(beat_ticks.name))

    def advance(
        self, entry: str, scheduled: dt.datetime, *, conn: sa.Connection | None = None
    ) -> bool:
        """Record ``scheduled`` as ``entry``'s last fired tick if it is later than the stored one;
        returns whether the row moved (False: a tick as late or later was already stored).
        On ``conn`` (in its transaction) when given, else on its own (autocommit)."""
        stmt = sql.beat_tick_advance(
            self._store.dialect, entry=entry, scheduled=as_utc(scheduled), now=utcnow()
        )
        if conn is not None:
            return conn.execute(stmt).first() is not None
        with self._store.db.connect() as own:
            return own.execute(stmt).first() is not None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """A connection of the store's engine in a transaction of its own (the engine's
        ``AUTOCOMMIT`` set aside for it): a tick's ``pending`` job row (``enqueue()``) and its
        :meth:`advance` commit together, and ``enqueue()``'s send goes after that commit."""
        level = "SERIALIZABLE" if self._store.dialect == "sqlite" else "READ COMMITTED"
        with self._store.db.connect() as conn:
            conn.execution_options(isolation_level=level)  # back to AUTOCOMMIT in the pool
            with conn.begin():
                yield conn

    def last(self, entry: str) -> dt.datetime | None:
        """``entry``'s last fired tick (UTC), or None when it never fired."""
        found = self.rows([entry])
        return found[0].last_scheduled if found else None

    def rows(self, entries: Sequence[str] | None = None) -> list[BeatTick]:
        """Every entry's row (only ``entries``' when given), by entry name."""
        with self._store.db.connect() as conn:
            return [
                BeatTick(r.entry, as_utc(r.last_scheduled), as_utc(r.updated_at))
                for r in conn.execute(sql.beat_ticks_of(entries)).all()
            ]
