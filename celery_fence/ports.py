"""What the task pipeline (claim -> register -> body -> settle) needs of its two backends, as
:class:`typing.Protocol` classes: the SQL store's job verbs (:class:`JobStore`, implemented by
:class:`celery_fence.store.Store`) and the Redis lease operations (:class:`LeaseBackend`,
implemented by :class:`celery_fence.lease.LeaseStore`).

:mod:`celery_fence.testing.memory` implements both in memory, with the same semantics, for fast
unit tests of the orchestration; ``tests/integration/test_doubles_contract.py`` runs the same
tests against the real classes and the doubles.

Only value types are imported here (no SQLAlchemy, no redis-py), so importing this module pulls
in neither backend.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .actions import Action
from .lease import LeaseKeys
from .records import Effect, JobRecord, Registration

__all__ = ["JobStore", "LeaseBackend"]


class JobStore(Protocol):
    """The fenced job verbs and reads of :class:`celery_fence.store.Store` the pipeline calls.

    Every write after :meth:`register` is fenced on ``(key, generation, attempt_id)`` and raises
    :class:`~celery_fence.errors.StaleGeneration` when that attempt no longer owns a running row.
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

    def complete(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        result: Any,
        effects: Sequence[Effect] = (),
    ) -> None: ...

    def complete_first(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request_json: str | None,
        result: Any,
        effects: Sequence[Effect] = (),
    ) -> None: ...

    def schedule_retry(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        error: BaseException | None,
        retry_at: dt.datetime,
        reason: str,
    ) -> None: ...

    def mark_dead(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        error: BaseException | None,
        reason: str,
        attempts: int | None = None,
    ) -> None: ...

    def bury(
        self,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any] | None,
        error: BaseException,
        reason: str,
    ) -> bool: ...

    def bury_refused(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request_json: str | None,
        error: BaseException,
        reason: str,
    ) -> None: ...

    def end_unrun(
        self,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any] | None,
        reason: str,
        only_insert: bool = False,
        terminated_id: str | None = None,
        insert: bool = True,
        message_id: str | None = None,
    ) -> None: ...

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
    """The lease operations of :class:`celery_fence.lease.LeaseStore` the pipeline and the
    :class:`~celery_fence.renewer.Renewer` call (the renewer calls :meth:`batch` only and reads
    no attribute). Lease values are ``"<token>:<generation>"``; TTLs are milliseconds."""

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
