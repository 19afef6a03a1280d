"""What the layers above need of the Redis lease, as a :class:`typing.Protocol`
(:class:`LeaseBackend`, implemented by :class:`celery_fence.leases.lease.LeaseStore`): the
pipeline's claim, renewal and release, and the :class:`~celery_fence.leases.renewer.Renewer`'s
batch. ``tests/support/memory.py`` implements it in memory;
``tests/integration/test_doubles_contract.py`` runs the same tests against both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from celery_fence.leases.lease import LeaseKeys

__all__ = ["LeaseBackend"]


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
