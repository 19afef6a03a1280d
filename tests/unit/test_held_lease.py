"""A held lease's local deadline, with a clock the test moves (no Redis, no sleeping)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_fence.errors import LeaseLost
from celery_fence.leases.lease import HeldLease


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lease(clock: Clock, **kw: Any) -> HeldLease:
    return HeldLease(
        key="k",
        lease_key="p:{x}:lease",
        token="t",
        generation=3,
        ttl=10.0,
        interval=3.0,
        margin=0.1,
        claimed_at=clock.now,
        clock=clock,
        **kw,
    )


def test_the_deadline_is_the_claim_plus_the_ttl_less_the_margin() -> None:
    clock = Clock()
    lease = _lease(clock)
    clock.now += 8.99
    lease.check()
    assert not lease.lost and lease.remaining() == pytest.approx(0.01)
    clock.now += 0.02
    assert lease.lost
    with pytest.raises(LeaseLost, match="deadline passed without a confirmed renewal"):
        lease.check()


def test_a_confirmed_renewal_extends_from_its_send_time_never_backwards() -> None:
    clock = Clock()
    lease = _lease(clock)
    lease.confirm(sent_at=105.0)  # confirmed later, counted from when it was sent
    assert lease.deadline == pytest.approx(114.0)
    lease.confirm(sent_at=101.0)  # an older renewal's late reply does not shorten it
    assert lease.deadline == pytest.approx(114.0)


def test_a_loss_is_final_and_reported_once() -> None:
    clock = Clock()
    seen: list[str] = []
    lease = _lease(clock, on_lost=lambda lease, reason: seen.append(reason))
    assert lease.mark_lost("renewal refused") and not lease.mark_lost("again")
    lease.confirm(sent_at=clock.now)  # a confirmation after the loss revives nothing
    with pytest.raises(LeaseLost, match="renewal refused"):
        lease.check()
    assert seen == ["renewal refused"]


def test_max_runtime_caps_the_deadline_whatever_renewals_say() -> None:
    clock = Clock()
    lease = _lease(clock, max_runtime=12.0)
    lease.confirm(sent_at=108.0)  # would reach 117; max_runtime ends it at 112
    assert lease.deadline == pytest.approx(112.0)
    clock.now = 112.5
    with pytest.raises(LeaseLost, match="fence_max_runtime exceeded"):
        lease.check()
