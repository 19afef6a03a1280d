"""The renewal thread against a real Redis: renews, loses loudly, decides from the deadline."""

from __future__ import annotations

import multiprocessing
import time

import redis

from celery_fence.errors import LeaseLost
from celery_fence.leases.lease import HeldLease, LeaseStore
from celery_fence.leases.renewer import Renewer
from celery_fence.process.runtime import runtime
from tests.integration.test_lease_scripts import CountingConnection
from tests.support.worker import wait_until


def _hold(
    leases: LeaseStore,
    key: str,
    *,
    ttl: float = 0.6,
    interval: float = 0.15,
    lost: list[str] | None = None,
) -> HeldLease:
    claimed_at = time.monotonic()
    g = leases.claim(key, f"tok-{key}", round(ttl * 1000))
    return HeldLease(
        key=key,
        lease_key=leases.keys_for(key).lease,
        token=f"tok-{key}",
        generation=g,
        ttl=ttl,
        interval=interval,
        margin=0.1,
        claimed_at=claimed_at,
        on_lost=(lambda lease, reason: lost.append(reason)) if lost is not None else None,
    )


def test_a_held_lease_outlives_its_ttl_while_renewed(leases: LeaseStore) -> None:
    renewer = Renewer(leases)
    lease = _hold(leases, "k")
    renewer.add(lease)
    time.sleep(1.5)  # 2.5 TTLs
    lease.check()  # does not raise
    assert leases.client.exists(lease.lease_key) == 1
    renewer.discard(lease)
    renewer.flush()
    wait_until(lambda: leases.client.exists(lease.lease_key) == 0, 5, what="release")
    renewer.stop()


def test_a_lease_taken_over_is_lost_at_the_next_renewal_and_the_owner_is_told(
    leases: LeaseStore,
) -> None:
    renewer = Renewer(leases)
    lost: list[str] = []
    lease = _hold(leases, "k", ttl=5.0, interval=0.1, lost=lost)
    renewer.add(lease)
    leases.client.set(lease.lease_key, "someone-else:99")  # a newer holder
    wait_until(lambda: lost, 5, what="on_lost")
    assert lost == ["lease expired or taken over in Redis"]
    try:
        lease.check()
        raise AssertionError("check() must raise once the lease is lost")
    except LeaseLost as exc:
        assert "generation" in str(exc)
    renewer.discard(lease)
    renewer.flush()
    assert leases.client.get(lease.lease_key) == b"someone-else:99"  # release compared the token
    renewer.stop()


def test_check_decides_from_the_local_deadline_without_the_thread(leases: LeaseStore) -> None:
    lost: list[str] = []
    lease = _hold(leases, "k", ttl=0.3, lost=lost)  # never added to a renewer
    lease.check()
    time.sleep(0.35)
    try:
        lease.check()
        raise AssertionError("check() must raise after the deadline")
    except LeaseLost:
        pass
    assert lost == ["deadline passed without a confirmed renewal"]


def test_unreachable_redis_loses_the_lease_at_its_deadline_loudly(
    leases: LeaseStore, caplog: object
) -> None:
    lost: list[str] = []
    lease = _hold(leases, "k", ttl=0.8, interval=0.1, lost=lost)
    dead = LeaseStore(
        redis.Redis(port=1, socket_connect_timeout=0.2, socket_timeout=0.2), prefix=leases.prefix
    )
    renewer = Renewer(dead)
    renewer.add(lease)
    wait_until(lambda: lost, 5, what="lease lost while Redis is unreachable")
    assert lost[0].startswith("renewal failed")
    assert time.monotonic() >= lease.deadline
    renewer.discard(lease, release=False)
    renewer.stop()


def test_one_round_trip_per_tick_whatever_the_number_of_leases(leases: LeaseStore) -> None:
    kwargs = leases.client.connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=CountingConnection, **kwargs)
    counted = LeaseStore(redis.Redis(connection_pool=pool), prefix=leases.prefix)
    held = [_hold(counted, f"k{i}", ttl=5.0, interval=0.2) for i in range(50)]
    renewer = Renewer(counted)
    before = CountingConnection.writes
    for lease in held:
        renewer.add(lease)
    time.sleep(1.1)
    writes = CountingConnection.writes - before
    ticks = renewer.ticks
    assert 3 <= ticks <= 7
    assert writes == ticks  # one pipelined round trip per tick for 50 leases
    for lease in held:
        renewer.discard(lease)
    renewer.flush()
    renewer.stop()


def _renewer(leases: LeaseStore) -> Renewer:
    """This process's renewer for ``leases``, as the backends ask the runtime for it."""
    return runtime().get("renewer", id(leases), lambda: Renewer(leases))


def _child(leases: LeaseStore, parent: Renewer, q: multiprocessing.Queue) -> None:
    renewer = _renewer(leases)
    lease = _hold(leases, "child", ttl=0.5, interval=0.1)
    renewer.add(lease)
    time.sleep(1.0)
    try:
        lease.check()
        q.put("held" if renewer is not parent else "the parent's renewer")
    except LeaseLost:
        q.put("lost")
    renewer.discard(lease)
    renewer.flush()


def test_a_forked_child_renews_with_a_renewer_of_its_own(leases: LeaseStore) -> None:
    # Given a parent whose renewer's thread runs (it holds a lease) ...
    renewer = _renewer(leases)
    parent_lease = _hold(leases, "parent", ttl=5.0)
    renewer.add(parent_lease)
    # when the process forks and the child holds a lease of its own (0.5 s TTL, for 1 s),
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(leases, renewer, q))
    p.start()
    p.join(timeout=20)
    # then the child's runtime gave it its own renewer, which kept the child's lease alive.
    assert q.get(timeout=5) == "held"
    renewer.discard(parent_lease)
    renewer.stop()


def test_releases_whose_round_trip_failed_are_kept_and_sent_later(
    leases: LeaseStore, redis_client: redis.Redis
) -> None:
    # Given a lease to release, and a renewer whose Redis cannot be reached,
    g = leases.claim("job:r", "tok", 30_000)
    lease_key = leases.keys_for("job:r").lease
    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    renewer = Renewer(LeaseStore(down, prefix=leases.prefix))
    try:
        renewer.return_releases([(lease_key, f"tok:{g}")], delay=0.0)
        # When its round trip fails, the release is kept, not dropped,
        wait_until(lambda: renewer.ticks >= 1, 5, what="a failed release round trip")
        assert renewer.pending_releases == [(lease_key, f"tok:{g}")]
        assert redis_client.get(lease_key) == f"tok:{g}".encode()
        # and once Redis answers again, it is sent (within the retry delay).
        renewer.leases = leases
        wait_until(lambda: redis_client.get(lease_key) is None, 5, what="the kept release sent")
        assert renewer.pending_releases == []
    finally:
        renewer.stop()


def test_past_max_runtime_a_lease_is_no_longer_renewed_and_frees_itself(
    leases: LeaseStore,
) -> None:
    # Given a lease renewed every 0.1 s (TTL 0.6 s) with a maximum runtime of 1 s ...
    renewer = Renewer(leases)
    lost: list[str] = []
    claimed_at = time.monotonic()
    g = leases.claim("hung", "tok-hung", 600)
    lease = HeldLease(
        key="hung",
        lease_key=leases.keys_for("hung").lease,
        token="tok-hung",
        generation=g,
        ttl=0.6,
        interval=0.1,
        margin=0.1,
        claimed_at=claimed_at,
        on_lost=lambda _, reason: lost.append(reason),
        max_runtime=1.0,
    )
    renewer.add(lease)
    time.sleep(0.8)  # past one TTL: renewals keep it
    lease.check()
    assert leases.client.exists(lease.lease_key) == 1
    # ... when the body is still running past its maximum runtime (never checking),
    # then the key frees itself within one TTL after it, check() raises, the owner is told,
    wait_until(lambda: leases.client.exists(lease.lease_key) == 0, 3, what="lease expired")
    assert time.monotonic() - claimed_at < 1.0 + 0.6 + 0.5
    try:
        lease.check()
        raise AssertionError("check() did not raise past fence_max_runtime")
    except LeaseLost as exc:
        assert "fence_max_runtime" in str(exc)
    assert lost and "fence_max_runtime" in lost[0]
    # and the next attempt takes the key over.
    assert leases.claim("hung", "tok-next", 600) == g + 1
    renewer.discard(lease)
    renewer.stop()
