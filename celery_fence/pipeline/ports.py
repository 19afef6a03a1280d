"""What the task pipeline (claim -> register -> body -> settle) needs of the SQL store, as a
:class:`typing.Protocol`: the job verbs (:class:`JobStore`, implemented by
:class:`celery_fence.store.Store`). Its need of the Redis lease is the leases layer's own port,
:class:`celery_fence.leases.ports.LeaseBackend` (the renewer below the pipeline needs it too).

The project's tests implement both in memory (``tests/support/memory.py``), with the same
semantics, for fast unit tests of the orchestration;
``tests/integration/test_doubles_contract.py`` runs the same tests against the real classes and
the doubles.

Only value types are imported here (no SQLAlchemy, no redis-py), so importing this module pulls
in no backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from celery_fence.actions import Action
from celery_fence.store.records import Ending, JobRecord, Registration

__all__ = ["JobStore", "TransitionReader"]


class TransitionReader(Protocol):
    """The transition read the pipeline needs (``store.transitions``)."""

    def last_exit(self, key: str) -> str | None:
        """The action of the key's newest transition that is not a claim, a lease loss or the
        retry of an interrupted attempt (None without one)."""
        ...


class JobStore(Protocol):
    """The fenced job verbs and reads of :class:`celery_fence.store.Store` the pipeline calls.

    After :meth:`register`, every ending of a job is one value
    (:data:`~celery_fence.store.records.Ending`) applied by :meth:`end`.
    """

    def register(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request: Mapping[str, Any] | None = None,
        request_json: str | None = None,
        took_over: bool = False,
    ) -> Registration: ...

    def end(self, key: str, ending: Ending) -> bool:
        """Apply ``ending``: True, or :class:`~celery_fence.errors.StaleGeneration` for a fenced
        one (:data:`~celery_fence.store.records.FENCED_ENDINGS`) whose attempt does not own the row;
        for the others, whether the row changed."""
        ...

    def record(
        self,
        key: str,
        *,
        action: Action | str,
        generation: int | None = None,
        attempt_id: str | None = None,
        reason: str | None = None,
    ) -> None: ...

    def get(self, key: str) -> JobRecord | None: ...

    @property
    def transitions(self) -> TransitionReader:
        """The reads of the key's transition rows (``last_exit``)."""
        ...
