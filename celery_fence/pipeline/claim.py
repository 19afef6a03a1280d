"""What an attempt's claim and registration decided (a :class:`Claim`, a frozen value), and the
steps around the claim that need no execution: the cluster-wide limits taken before it, the
takeover counted after it.

:meth:`~celery_fence.pipeline.execution.Execution.run` claims a generation and registers it; each
step gives a new :class:`Claim` (never changes one), and the settle step reads the last one:
``settle(execution, claim, outcome)``.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from celery_fence import metrics
from celery_fence.actions import Action, LogAction
from celery_fence.config import FenceConfig
from celery_fence.errors import LeaseBusy
from celery_fence.leases.lease import HeldLease, LeaseStore
from celery_fence.leases.limits import Limits, Slot
from celery_fence.leases.ports import LeaseBackend
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline.outcomes import Limited, Outcome, Unavailable

logger = logging.getLogger("celery_fence")

#: Seconds a message over its group's limit waits at most before it looks again (less when the
#: soonest slot expires sooner); a slot usually frees long before its lease would expire.
GROUP_POLL = 1.0

#: The re-send reasons of a message over a limit (the ``retry_scheduled`` row's reason).
GROUP_FULL, RATE_LIMITED = "group_full", "rate_limited"


@dataclass(frozen=True, slots=True)
class Claim:
    """An attempt's claim as far as it got. Before the claim only ``token`` (the attempt id, the
    lease's token) and ``run_number`` (the message's re-run) are set; the claim adds the
    generation and its lease, the registration ``registered``, ``attempts`` and the run the
    stored request says."""

    #: The attempt id: the token of its lease, its slot and its rows.
    token: str
    #: The generation Redis handed out (None: not claimed).
    generation: int | None = None
    #: The lease of that generation, renewed by the renewer until the attempt ends.
    lease: HeldLease | None = None
    #: The group slot this attempt holds (``fence_group_limit``), renewed with its lease.
    slot: HeldLease | None = None
    #: ``time.monotonic()`` of the claim that got the lease (the metrics' attempt duration).
    claimed_at: float | None = None
    #: The store registered this generation: the body may run (and its endings are fenced).
    registered: bool = False
    #: Executions counted by the store, this one included (0: not registered).
    attempts: int = 0
    #: The operator's re-run this attempt belongs to (its outbox effects' idempotency keys).
    run_number: int = 0
    #: The generation this registration took over from a recovery's re-send (None: none).
    took_over: int | None = None


class SlotClaim(NamedTuple):
    """Who asks for a group slot, and what to do with it: ``hold`` is given the slot's lease as
    soon as it is taken (the attempt gives it back when it ends); ``on_lost`` is called when it
    expires or is taken over."""

    key: str
    token: str
    group: str | None
    max_runtime: float | None
    hold: Callable[[HeldLease], None]
    on_lost: Callable[[HeldLease, str], None]


def slot_rides_claim(
    limits: Limits | None, leases: LeaseBackend, config: FenceConfig, group: str | None
) -> bool:
    """Whether the group's slot is taken in the key's claim, one round trip
    (:meth:`~celery_fence.leases.limits.Limits.claim_in_group`): a group limit and no rate limit
    (whose token is taken between the two), on one Redis (not a Cluster), the leases' own
    client."""
    return (
        limits is not None
        and group is not None
        and config.group_limit is not None
        and config.rate is None
        and limits.carries_releases
        and isinstance(leases, LeaseStore)
        and leases.client is limits.client
    )


def _hold(
    taken: Slot, slot: SlotClaim, config: FenceConfig, renewer: Renewer, claimed_at: float
) -> None:
    """Keep the group slot ``taken``: renewed with the lease, released when the attempt ends
    (its release rides in a later claim or renewal)."""
    held = HeldLease(
        key=slot.key,
        lease_key=taken.lease_key,
        token=taken.token,
        generation=taken.index,
        ttl=config.lease_ttl,
        interval=config.renew_interval,
        margin=config.lease_margin,
        claimed_at=claimed_at,
        max_runtime=slot.max_runtime,
        on_lost=slot.on_lost,
    )
    slot.hold(held)
    renewer.add(held)


def take_limits(
    limits: Limits,
    config: FenceConfig,
    renewer: Renewer,
    slot: SlotClaim,
    *,
    task_name: str,
    in_claim: bool = False,
) -> Outcome | None:
    """Before the claim: a slot of the group (``fence_group_limit``; not when it is taken in the
    claim's own round trip, ``in_claim``), then a token of the rate limit (``fence_rate_limit``;
    the group's bucket when a group is set). None when the attempt may claim, else the outcome
    (over a limit, or Redis unavailable). The slot is a lease renewed with the key's; losing it
    loses the key's lease too (``slot.on_lost``)."""
    group, limit, rate = slot.group, config.group_limit, config.rate
    try:
        if group is not None and limit is not None and not in_claim:
            claimed_at = time.monotonic()
            # the process's queued releases ride in this round trip, as in the key's claim
            releases = renewer.take_releases() if limits.carries_releases else []
            try:
                taken = limits.claim_slot(
                    group, limit, f"{slot.token}/slot", config.lease_ttl_ms, releases=releases
                )
            except BaseException:
                renewer.return_releases(releases)
                raise
            if not isinstance(taken, Slot):
                detail = f"all {limit} slots of group {group!r} are taken"
                return Limited(GROUP_FULL, min(taken, GROUP_POLL), detail)
            _hold(taken, slot, config, renewer, claimed_at)
        if rate is not None:
            bucket = f"group:{group}" if group is not None else f"task:{task_name}"
            wait = limits.take_token(bucket, rate)
            if wait > 0:
                return Limited(RATE_LIMITED, wait, f"{rate.text} reached for {bucket!r}")
    except Exception as exc:  # Redis unreachable or refusing: re-send, never drop
        return Unavailable(exc, f"lease store unavailable ({type(exc).__name__})")
    return None


def claim_in_group(
    limits: Limits,
    leases: LeaseBackend,
    config: FenceConfig,
    renewer: Renewer,
    slot: SlotClaim,
    releases: Sequence[tuple[str, str]],
    claimed_at: float,
) -> int | Limited:
    """Claim the key and a slot of its group in one round trip (where :func:`slot_rides_claim`):
    the new generation (the slot held and renewed), or group_full; raises
    :class:`~celery_fence.errors.LeaseBusy` when the key's lease is live (no slot was taken)."""
    group, limit = slot.group, config.group_limit
    assert isinstance(leases, LeaseStore) and group is not None and limit is not None
    keys = leases.keys_for(slot.key)
    answer = limits.claim_in_group(
        keys.lease,
        keys.generation,
        group,
        limit,
        slot.token,
        config.lease_ttl_ms,
        leases.generation_ttl_ms,
        releases=releases,
    )
    if answer.status == "busy":
        raise LeaseBusy(f"lease for {slot.key!r} is held by another attempt", remaining=answer.wait)
    if answer.status == "full" or answer.slot is None:
        detail = f"all {limit} slots of group {group!r} are taken"
        return Limited(GROUP_FULL, min(answer.wait, GROUP_POLL), detail)
    _hold(answer.slot, slot, config, renewer, claimed_at)
    return answer.generation


def regressed(key: str, token: str, generation: int, stored: int) -> None:
    """Log that Redis handed out ``generation`` although the store already saw ``stored`` (its
    counter was lost): the claim raises the counter and claims again."""
    logger.warning(
        "fence generation regressed key=%s generation=%s stored=%s; raising the counter",
        key,
        generation,
        stored,
        extra={
            "action": LogAction.REGRESSED,
            "fence_key": key,
            "attempt_id": token,
            "generation": generation,
            "reason": "redis counter behind the store",
        },
    )


def count_takeover(moved: dt.datetime, task_name: str, observer: metrics.Metrics) -> None:
    """Count a takeover: the registration took over a row another attempt of an older
    generation left ``running``, which last moved at ``moved`` (its registration, or its last
    fenced commit; :attr:`~celery_fence.store.records.Registration.took_over_from`)."""
    if moved.tzinfo is None:
        moved = moved.replace(tzinfo=dt.timezone.utc)
    seconds = (dt.datetime.now(dt.timezone.utc) - moved).total_seconds()
    observer.took_over(task_name, seconds)


def announce_takeover(
    announce: Callable[..., None], takeover: tuple[int, float], generation: int
) -> int | None:
    """``job_taken_over``, when the registration of ``generation`` took over the one a
    recovery found stranded (``takeover``: the message's ``fence_takeover`` header): with the
    seconds from that attempt's last move to now. The generation taken over, or None."""
    previous, moved = takeover
    if not previous < generation:
        return None
    seconds = max(0.0, time.time() - moved)
    announce(
        Action.TAKEN_OVER,
        f"generation {previous} taken over after {seconds:.1f}s",
        previous_generation=previous,
        seconds=seconds,
    )
    return previous


__all__ = [
    "GROUP_FULL",
    "GROUP_POLL",
    "RATE_LIMITED",
    "Claim",
    "SlotClaim",
    "announce_takeover",
    "claim_in_group",
    "count_takeover",
    "slot_rides_claim",
    "take_limits",
]
