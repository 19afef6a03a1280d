"""The outbox's rows: claim, mark, fail, requeue and purge rows of ``fence_outbox`` (the
statements are in :mod:`.outbox_sql`). Composed into the job store as ``store.outbox_rows``; rows
are written only by the fenced completion (:mod:`.fenced`), with the result.
The staging side is :class:`~celery_fence.body.effects.StagedEffects`, the delivery side
:class:`~celery_fence.ops.outbox.Outbox`.

A sender claims a row for ``claim_ttl`` seconds under a claim token of its own; marking and
failing are conditional on that token, so a sender whose claim expired and was taken over
cannot change the row. Claim expiry and due times are compared on the database's clock
(PostgreSQL ``now()``), so senders on hosts with skewed clocks agree on when a claim has expired;
SQLite is one host.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_fence.schema import OutboxStatus, utcnow
from celery_fence.store import outbox_sql, sql

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store


@dataclass(frozen=True)
class OutboxRow:
    """One row of ``fence_outbox``: a committed effect and its delivery state."""

    id: int
    key: str
    name: str
    idempotency_key: str
    payload: Any
    status: str  # an OutboxStatus value
    attempts: int  # claims so far (a claim that crashed counts too)
    available_at: dt.datetime
    claimed_by: str | None
    claimed_until: dt.datetime | None
    last_error: str | None
    created_at: dt.datetime
    delivered_at: dt.datetime | None


class OutboxRows:
    """The rows of ``fence_outbox``, ``store.outbox_rows`` of a :class:`~celery_fence.store.Store`
    (its engine and error fields)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def _now(self) -> Any:
        """The current time as the database sees it (PostgreSQL), or this process's (SQLite)."""
        return sa.func.now() if self._store.dialect == "postgresql" else utcnow()

    def _later(self, seconds: float) -> Any:
        if self._store.dialect == "postgresql":
            return sa.func.now() + sa.literal(dt.timedelta(seconds=seconds), sa.Interval)
        return utcnow() + dt.timedelta(seconds=seconds)

    def _all(self, stmt: Any) -> list[OutboxRow]:
        with self._store.db.connect() as conn:
            return [_outbox_row(r) for r in conn.execute(stmt).all()]

    def _changed(self, stmt: Any) -> bool:
        with self._store.db.connect() as conn:
            return conn.execute(stmt).first() is not None

    def dead_exhausted(self, *, max_attempts: int, key: str | None = None) -> Sequence[OutboxRow]:
        """Move due ``pending`` rows already claimed ``max_attempts`` times to ``dead``.

        Each claim counts an attempt when it is made, so a row whose handler kills its worker
        (the sender never reaches its failure path) still runs out of attempts: once its last
        claim expired unmarked, it goes ``dead`` here instead of being claimed again.
        """
        return self._all(
            outbox_sql.outbox_dead_exhausted(now=self._now(), max_attempts=max_attempts, key=key)
        )

    def claim(
        self,
        *,
        claimer: str,
        claim_ttl: float,
        limit: int = 1,
        key: str | None = None,
        after_id: int = 0,
    ) -> Sequence[OutboxRow]:
        """Claim up to ``limit`` due ``pending`` rows (oldest first) for ``claim_ttl`` seconds.

        A row is due when ``available_at`` has passed and no live claim holds it; only rows with
        an id above ``after_id`` are considered (a sender's cursor). Each claim counts one attempt.
        PostgreSQL: ``FOR UPDATE SKIP LOCKED`` in one statement; SQLite: the same conditional
        ``UPDATE`` under ``BEGIN IMMEDIATE`` (writers are serialized).
        """
        stmt = outbox_sql.outbox_claim(
            self._store.dialect,
            now=self._now(),
            until=self._later(claim_ttl),
            claimer=claimer,
            limit=limit,
            key=key,
            after_id=after_id,
        )
        if self._store.dialect == "postgresql":
            rows = self._all(stmt)
        else:
            with self._store.db.tx() as conn:
                rows = [_outbox_row(r) for r in conn.execute(stmt).all()]
        return sorted(rows, key=lambda r: r.id)

    def mark_delivered(self, row_id: int, *, claimer: str) -> bool:
        """Mark a claimed row delivered; False when the claim is no longer this sender's."""
        values = {
            "status": OutboxStatus.DELIVERED.value,
            "delivered_at": utcnow(),
            "claimed_until": None,
            "last_error": None,
        }
        return self._changed(outbox_sql.outbox_update_claimed(row_id, claimer, values))

    def fail(
        self,
        row_id: int,
        *,
        claimer: str,
        error: BaseException,
        retry_at: dt.datetime | None = None,
        retry_in: float | None = None,
    ) -> bool:
        """Record a failed delivery: due again ``retry_in`` seconds from now on the database's
        clock (or at ``retry_at``), or ``dead`` when neither is given.

        False when the claim is no longer this sender's (nothing changes).
        """
        fields = self._store._error_fields(error)
        last_error = f"{fields['error_type']}: {fields['error_message']}"[:2000]
        values: dict[str, Any] = {"claimed_until": None, "last_error": last_error}
        if retry_in is not None:
            values["available_at"] = self._later(retry_in)
        elif retry_at is not None:
            values["available_at"] = retry_at
        else:
            values["status"] = OutboxStatus.DEAD.value
        return self._changed(outbox_sql.outbox_update_claimed(row_id, claimer, values))

    def requeue(self, row_id: int) -> bool:
        """Move a ``dead`` outbox row back to ``pending`` with a fresh attempt count."""
        return bool(self.requeue_many([row_id]))

    def requeue_many(self, ids: Sequence[int]) -> list[int]:
        """Move the rows of ``ids`` that are still ``dead`` back to ``pending``, due now, with a
        fresh attempt count, in one conditional statement; the ids it moved (a row that is not
        ``dead`` when it runs — pending, delivered, requeued meanwhile — is left as it is)."""
        if not ids:
            return []
        return self._ids(outbox_sql.outbox_requeue(ids, self._now()))

    def requeue_dead(self, *, key: str | None = None) -> list[int]:
        """Move every ``dead`` row (of ``key``, or all) back to ``pending`` as
        :meth:`requeue_many` does; the ids it moved."""
        return self._ids(outbox_sql.outbox_requeue(None, self._now(), key=key))

    def statuses(self, ids: Sequence[int]) -> dict[int, str]:
        """The status of each row of ``ids`` that exists (a missing id is not in the dict)."""
        if not ids:
            return {}
        with self._store.db.connect() as conn:
            return {int(i): str(s) for i, s in conn.execute(outbox_sql.outbox_statuses(ids)).all()}

    def _ids(self, stmt: Any) -> list[int]:
        with self._store.db.connect() as conn:
            return sorted(int(r[0]) for r in conn.execute(stmt).all())

    def purge(self, *, delivered_before: dt.datetime) -> int:
        """Delete rows delivered before the date (``dead`` rows stay until requeued or fixed)."""
        with self._store.db.connect() as conn:
            return int(conn.execute(outbox_sql.outbox_purge(delivered_before)).rowcount or 0)

    def rows(
        self,
        *,
        key: str | None = None,
        status: str | None = None,
        limit: int = 1000,
        newest_first: bool = False,
    ) -> Sequence[OutboxRow]:
        """Outbox rows, oldest first (``newest_first``: the newest ``limit``, newest first)."""
        return self._all(
            outbox_sql.outbox_rows(key=key, status=status, limit=limit, newest_first=newest_first)
        )

    def summary(self) -> dict[str, tuple[int, dt.datetime | None]]:
        """``{status: (rows, oldest created_at)}``, one grouped read (the metrics' gauges)."""
        with self._store.db.connect() as conn:
            rows = conn.execute(sql.outbox_status_summary()).all()
        return {r[0]: (int(r[1]), r[2]) for r in rows}


def _outbox_row(row: Any) -> OutboxRow:
    m = row._mapping
    return OutboxRow(**{name: m[name] for name in OutboxRow.__dataclass_fields__})
