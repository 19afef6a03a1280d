"""The reads of a key's transition rows (``store.transitions``): its whole history, for the
operator (``fence show``), the checkers and the tests, and how its latest attempt ended, for the
settle step of an attempt that found the budget spent. The rows themselves are written by the
one fenced write (:mod:`.fenced`), with the state change they record."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_fence.store import sql
from celery_fence.store.records import Transition

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store


class TransitionReads:
    """The transition reads of one :class:`~celery_fence.store.Store` (``store.transitions``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def history(self, key: str) -> list[Transition]:
        """Every transition row of ``key``, oldest first."""
        with self.store.db.connect() as conn:
            rows = conn.execute(sql.history(key)).all()
        return [
            Transition(r.key, r.generation, r.attempt_id, r.action, r.reason, r.at) for r in rows
        ]

    def last_exit(self, key: str) -> str | None:
        """How the key's latest attempt before this one ended, as far as the history says: the
        action of its newest transition row that is not a claim or a lease loss (None without
        one)."""
        with self.store.db.connect() as conn:
            return conn.execute(sql.last_exit(key)).scalar()
