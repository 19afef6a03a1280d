"""The outbox's SQL: claim, mark, fail, requeue and purge rows of ``fence_outbox``.

A mixin of :class:`celery_fence.store.Store` (the store stays the one place that runs SQL; this
file keeps the outbox's statements apart from the fenced job path). Rows are written only by
:meth:`Store.complete`, with the fenced result.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from .schema import outbox, utcnow


@dataclass(frozen=True)
class OutboxRow:
    """One row of ``fence_outbox``: a committed effect and its delivery state."""

    id: int
    key: str
    name: str
    idempotency_key: str
    payload: Any
    status: str  # pending, delivered, dead
    attempts: int  # claims so far (a claim that crashed counts too)
    available_at: dt.datetime
    claimed_by: str | None
    claimed_until: dt.datetime | None
    last_error: str | None
    created_at: dt.datetime
    delivered_at: dt.datetime | None


class OutboxStore:
    """The outbox half of the store; needs ``engine``, ``dialect``, ``_tx`` and
    ``_error_fields`` from :class:`~celery_fence.store.Store`."""

    dialect: str

    @property
    def engine(self) -> sa.Engine:
        raise NotImplementedError

    def _tx(self) -> contextlib.AbstractContextManager[sa.Connection]:
        raise NotImplementedError

    def _error_fields(self, error: BaseException | None) -> dict[str, Any]:
        raise NotImplementedError

    # -- outbox: claim, mark, fail (used by celery_fence.outbox's sender) -------------------------
    #
    # A sender claims a row for ``claim_ttl`` seconds under a claim token of its own; marking and
    # failing are conditional on that token, so a sender whose claim expired and was taken over
    # cannot change the row. Rows are written only by :meth:`complete` (with the fenced result).
    # Claim expiry and due times are compared on the database's clock (PostgreSQL ``now()``), so
    # senders on hosts with skewed clocks agree on when a claim has expired; SQLite is one host.

    def _db_now(self) -> Any:
        """The current time as the database sees it (PostgreSQL), or this process's (SQLite)."""
        return sa.func.now() if self.dialect == "postgresql" else utcnow()

    def _db_later(self, seconds: float) -> Any:
        if self.dialect == "postgresql":
            return sa.func.now() + sa.literal(dt.timedelta(seconds=seconds), sa.Interval)
        return utcnow() + dt.timedelta(seconds=seconds)

    def outbox_bury_exhausted(
        self, *, max_attempts: int, key: str | None = None
    ) -> Sequence[OutboxRow]:
        """Move due ``pending`` rows already claimed ``max_attempts`` times to ``dead``.

        Each claim counts an attempt when it is made, so a row whose handler kills its worker
        (the sender never reaches its failure path) still runs out of attempts: once its last
        claim expired unmarked, it goes ``dead`` here instead of being claimed again.
        """
        now = self._db_now()
        exhausted = (
            (outbox.c.status == "pending")
            & (outbox.c.attempts >= max_attempts)
            & (outbox.c.available_at <= now)
            & (outbox.c.claimed_until.is_(None) | (outbox.c.claimed_until < now))
        )
        if key is not None:
            exhausted = exhausted & (outbox.c.key == key)
        stmt = (
            outbox.update()
            .where(exhausted)
            .values(
                status="dead",
                claimed_until=None,
                last_error=(
                    f"claimed {max_attempts} time(s) without being marked delivered or failed "
                    "(did the handler kill or hang its worker?)"
                ),
            )
            .returning(*outbox.c)
        )
        with self.engine.connect() as conn:
            return [_outbox_row(r) for r in conn.execute(stmt).all()]

    def outbox_claim(
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
        now = self._db_now()
        due = (
            (outbox.c.status == "pending")
            & (outbox.c.available_at <= now)
            & (outbox.c.claimed_until.is_(None) | (outbox.c.claimed_until < now))
            & (outbox.c.id > after_id)
        )
        if key is not None:
            due = due & (outbox.c.key == key)
        ids = sa.select(outbox.c.id).where(due).order_by(outbox.c.id).limit(limit)
        claim = outbox.update().values(
            claimed_by=claimer[:64],
            claimed_until=self._db_later(claim_ttl),
            attempts=outbox.c.attempts + 1,
        )
        if self.dialect == "postgresql":
            # A CTE runs once: "id IN (SELECT ... SKIP LOCKED LIMIT n)" may be re-run per row.
            picked = ids.with_for_update(skip_locked=True).cte("picked")
            stmt = claim.where(outbox.c.id == picked.c.id).returning(*outbox.c)
            with self.engine.connect() as conn:
                rows = conn.execute(stmt).all()
        else:
            stmt = claim.where(outbox.c.id.in_(ids.scalar_subquery()) & due).returning(*outbox.c)
            with self._tx() as conn:
                rows = conn.execute(stmt).all()
        return sorted((_outbox_row(r) for r in rows), key=lambda r: r.id)

    def outbox_mark_delivered(self, row_id: int, *, claimer: str) -> bool:
        """Mark a claimed row delivered; False when the claim is no longer this sender's."""
        return self._update_claimed(
            row_id,
            claimer,
            status="delivered",
            delivered_at=utcnow(),
            claimed_until=None,
            last_error=None,
        )

    def _update_claimed(self, row_id: int, claimer: str, **values: Any) -> bool:
        """Set ``values`` on a pending row only while ``claimer`` holds its claim."""
        stmt = (
            outbox.update()
            .where(
                (outbox.c.id == row_id)
                & (outbox.c.claimed_by == claimer[:64])
                & (outbox.c.status == "pending")
            )
            .values(**values)
            .returning(outbox.c.id)
        )
        with self.engine.connect() as conn:
            return conn.execute(stmt).first() is not None

    def outbox_fail(
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
        fields = self._error_fields(error)
        last_error = f"{fields['error_type']}: {fields['error_message']}"[:2000]
        values: dict[str, Any] = {"claimed_until": None, "last_error": last_error}
        if retry_in is not None:
            values["available_at"] = self._db_later(retry_in)
        elif retry_at is not None:
            values["available_at"] = retry_at
        else:
            values["status"] = "dead"
        return self._update_claimed(row_id, claimer, **values)

    def outbox_requeue(self, row_id: int) -> bool:
        """Move a ``dead`` outbox row back to ``pending`` with a fresh attempt count."""
        stmt = (
            outbox.update()
            .where((outbox.c.id == row_id) & (outbox.c.status == "dead"))
            .values(status="pending", attempts=0, available_at=utcnow(), claimed_by=None)
            .returning(outbox.c.id)
        )
        with self.engine.connect() as conn:
            return conn.execute(stmt).first() is not None

    def outbox_purge(self, *, delivered_before: dt.datetime) -> int:
        """Delete rows delivered before the date (``dead`` rows stay until requeued or fixed)."""
        done = (outbox.c.status == "delivered") & (outbox.c.delivered_at < delivered_before)
        with self.engine.connect() as conn:
            return int(conn.execute(outbox.delete().where(done)).rowcount or 0)

    def outbox_rows(
        self, *, key: str | None = None, status: str | None = None, limit: int = 1000
    ) -> Sequence[OutboxRow]:
        """Outbox rows, oldest first (operators, tests, the demo)."""
        query = sa.select(outbox).order_by(outbox.c.id).limit(limit)
        if key is not None:
            query = query.where(outbox.c.key == key)
        if status is not None:
            query = query.where(outbox.c.status == status)
        with self.engine.connect() as conn:
            return [_outbox_row(r) for r in conn.execute(query).all()]


def _outbox_row(row: Any) -> OutboxRow:
    m = row._mapping
    return OutboxRow(**{name: m[name] for name in OutboxRow.__dataclass_fields__})
