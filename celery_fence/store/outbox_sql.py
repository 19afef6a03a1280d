"""The outbox's statements (SQLAlchemy Core, built per call; ``now`` is the database's clock or
this process's), run by :mod:`.outbox` (``store.outbox_rows``). The outbox inserts that ride
along with a fenced write are in :file:`queries.sql` (``with_effects``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_fence.schema import OutboxStatus, outbox


def _due(now: Any) -> Any:
    return (
        (outbox.c.status == OutboxStatus.PENDING.value)
        & (outbox.c.available_at <= now)
        & (outbox.c.claimed_until.is_(None) | (outbox.c.claimed_until < now))
    )


def outbox_dead_exhausted(*, now: Any, max_attempts: int, key: str | None) -> Any:
    exhausted = _due(now) & (outbox.c.attempts >= max_attempts)
    if key is not None:
        exhausted = exhausted & (outbox.c.key == key)
    return (
        outbox.update()
        .where(exhausted)
        .values(
            status=OutboxStatus.DEAD.value,
            claimed_until=None,
            last_error=(
                f"claimed {max_attempts} time(s) without being marked delivered or failed "
                "(did the handler kill or hang its worker?)"
            ),
        )
        .returning(*outbox.c)
    )


def outbox_claim(
    dialect: str,
    *,
    now: Any,
    until: Any,
    claimer: str,
    limit: int,
    key: str | None,
    after_id: int,
) -> Any:
    """Claim due rows: ``FOR UPDATE SKIP LOCKED`` in one statement on PostgreSQL (a CTE runs
    once: ``id IN (SELECT ... SKIP LOCKED LIMIT n)`` may be re-run per row); the same
    conditional ``UPDATE`` on SQLite, whose caller holds ``BEGIN IMMEDIATE``."""
    due = _due(now) & (outbox.c.id > after_id)
    if key is not None:
        due = due & (outbox.c.key == key)
    ids = sa.select(outbox.c.id).where(due).order_by(outbox.c.id).limit(limit)
    claim = outbox.update().values(
        claimed_by=claimer[:64], claimed_until=until, attempts=outbox.c.attempts + 1
    )
    if dialect == "postgresql":
        picked = ids.with_for_update(skip_locked=True).cte("picked")
        return claim.where(outbox.c.id == picked.c.id).returning(*outbox.c)
    return claim.where(outbox.c.id.in_(ids.scalar_subquery()) & due).returning(*outbox.c)


def outbox_update_claimed(row_id: int, claimer: str, values: dict[str, Any]) -> Any:
    """Set ``values`` on a pending row only while ``claimer`` holds its claim."""
    return (
        outbox.update()
        .where(
            (outbox.c.id == row_id)
            & (outbox.c.claimed_by == claimer[:64])
            & (outbox.c.status == OutboxStatus.PENDING.value)
        )
        .values(**values)
        .returning(outbox.c.id)
    )


def outbox_requeue(ids: Sequence[int] | None, now: Any, key: str | None = None) -> Any:
    """``dead`` rows back to ``pending``, due now, with a fresh attempt count: those of ``ids``
    (None: every dead row, or ``key``'s) that are still ``dead`` when the statement runs."""
    still_dead = outbox.c.status == OutboxStatus.DEAD.value
    if ids is not None:
        still_dead = still_dead & outbox.c.id.in_(list(ids))
    if key is not None:
        still_dead = still_dead & (outbox.c.key == key)
    return (
        outbox.update()
        .where(still_dead)
        .values(
            status=OutboxStatus.PENDING.value,
            attempts=0,
            available_at=now,
            claimed_by=None,
            claimed_until=None,
        )
        .returning(outbox.c.id)
    )


def outbox_statuses(ids: Sequence[int]) -> sa.Select[Any]:
    """``(id, status)`` of the rows of ``ids`` that exist."""
    return sa.select(outbox.c.id, outbox.c.status).where(outbox.c.id.in_(list(ids)))


def outbox_purge(delivered_before: dt.datetime) -> Any:
    return outbox.delete().where(
        (outbox.c.status == OutboxStatus.DELIVERED.value)
        & (outbox.c.delivered_at < delivered_before)
    )


def outbox_rows(
    *, key: str | None, status: str | None, limit: int, newest_first: bool = False
) -> sa.Select[Any]:
    order = outbox.c.id.desc() if newest_first else outbox.c.id
    query = sa.select(outbox).order_by(order).limit(limit)
    if key is not None:
        query = query.where(outbox.c.key == key)
    if status is not None:
        query = query.where(outbox.c.status == status)
    return query
