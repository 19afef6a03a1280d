"""What the task pipeline (claim -> register -> body -> settle) needs of its two backends, as
:class:`typing.Protocol` classes: the SQL store's job verbs (:class:`JobStore`, implemented by
:class:`celery_fence.store.Store`) and the Redis lease operations (:class:`LeaseBackend`,
implemented by :class:`celery_fence.leases.lease.LeaseStore`).

The project's tests implement both in memory (``tests/support/memory.py``), with the same
semantics, for fast unit tests of the orchestration;
``tests/integration/test_doubles_contract.py`` runs the same tests against the real classes and
the doubles.

Only value types are imported here (no SQLAlchemy, no redis-py), so importing this module pulls
in neither backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from celery_fence.actions import Action
from celery_fence.leases.lease import LeaseKeys
from celery_fence.store.records import Ending, JobRecord, Registration

__all__ = ["JobStore", "LeaseBackend"]


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

    def last_exit(self, key: str) -> str | None: ...


class LeaseBackend(Protocol):
    """The lease operations of :class:`celery_fence.leases.lease.LeaseStore` the pipeline and the
    :class:`~celery_fence.leases.renewer.Renewer` call (the renewer calls :meth:`batch` only and
    reads no attribute). Lease values are ``"<token>:<generation>"``; TTLs are milliseconds."""

    def keys_for(self, key: str) -> LeaseKeys: ...

    def claim(
        self, key: str, token: str, ttl_ms: int, *, releases: Sequence[tuple[str, str]] = ()
    ) -> int: ...

    def raise_generation(self, key: str, floor: int) -> int: ...

    def take_generation(self, key: str) -> int: ...

    def release(self, lease_key: str, value: str) -> bool: ...

    def renew(self, lease_key: str, value: str, ttl_ms: int) -> bool: ...

    def batch(
        self,
        renewals: Sequence[tuple[str, str, int]],
        releases: Sequence[tuple[str, str]],
    ) -> tuple[list[bool], list[bool]]: ...

    def remaining(self, key: str) -> tuple[float | None, int | None]: ...
