"""The Lua scripts against a real Redis: claim, busy, renew, renew-after-expiry refused,
compare-and-delete, set-if-greater — and the pipelined batch the renewer uses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from celery_fence.errors import LeaseBusy
from celery_fence.leases.lease import LeaseStore


def test_claim_increments_generation_and_sets_the_lease(leases: LeaseStore) -> None:
    g1 = leases.claim("report:1", "tok-a", 5_000)
    keys = leases.keys_for("report:1")
    assert leases.client.get(keys.lease) == f"tok-a:{g1}".encode()
    assert 4_000 < leases.client.pttl(keys.lease) <= 5_000
    assert leases.release(keys.lease, f"tok-a:{g1}")
    g2 = leases.claim("report:1", "tok-b", 5_000)
    assert g2 == g1 + 1


def test_claim_on_a_live_lease_is_busy_with_the_holders_remaining_ttl(leases: LeaseStore) -> None:
    g = leases.claim("k", "tok-a", 3_000)
    with pytest.raises(LeaseBusy) as busy:
        leases.claim("k", "tok-b", 3_000)
    assert 2.0 < busy.value.remaining <= 3.0
    # the busy claim neither took the lease nor consumed a generation
    keys = leases.keys_for("k")
    assert leases.client.get(keys.lease) == f"tok-a:{g}".encode()
    assert int(leases.client.get(keys.generation)) == g


def test_renew_extends_only_the_owners_lease(leases: LeaseStore) -> None:
    g = leases.claim("k", "tok-a", 1_000)
    keys = leases.keys_for("k")
    assert leases.renew(keys.lease, f"tok-a:{g}", 5_000)
    assert leases.client.pttl(keys.lease) > 4_000
    assert not leases.renew(keys.lease, f"tok-b:{g}", 5_000)  # wrong token
    assert not leases.renew(keys.lease, f"tok-a:{g + 1}", 5_000)  # wrong generation


def test_renew_after_expiry_is_refused_and_does_not_revive(leases: LeaseStore) -> None:
    g = leases.claim("k", "tok-a", 50)
    keys = leases.keys_for("k")
    time.sleep(0.12)
    assert not leases.renew(keys.lease, f"tok-a:{g}", 5_000)
    assert leases.client.exists(keys.lease) == 0


def test_release_is_compare_and_delete(leases: LeaseStore) -> None:
    g = leases.claim("k", "tok-a", 5_000)
    keys = leases.keys_for("k")
    assert not leases.release(keys.lease, f"tok-b:{g}")
    assert leases.client.exists(keys.lease) == 1  # someone else's release removed nothing
    assert leases.release(keys.lease, f"tok-a:{g}")
    assert leases.client.exists(keys.lease) == 0
    # A newer holder's lease survives the old holder's late release.
    g2 = leases.claim("k", "tok-b", 5_000)
    assert not leases.release(keys.lease, f"tok-a:{g}")
    assert leases.client.get(keys.lease) == f"tok-b:{g2}".encode()


def test_raise_generation_is_set_if_greater(leases: LeaseStore) -> None:
    assert leases.raise_generation("k", 41) == 41
    assert leases.raise_generation("k", 7) == 41  # never lowers
    assert leases.claim("k", "tok", 1_000) == 42


class CountingConnection(redis.Connection):
    """Counts network writes: one per command, one per pipeline."""

    writes = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        type(self).writes += 1
        super().send_packed_command(command, check_health)


def test_batch_renews_and_releases_in_one_round_trip(leases: LeaseStore) -> None:
    held = []
    for i in range(20):
        g = leases.claim(f"k{i}", f"t{i}", 1_000)
        held.append((leases.keys_for(f"k{i}").lease, f"t{i}:{g}"))
    kwargs = leases.client.connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=CountingConnection, **kwargs)
    counted = LeaseStore(redis.Redis(connection_pool=pool), prefix=leases.prefix)
    counted.client.ping()
    before = CountingConnection.writes
    renewed, released = counted.batch([(k, v, 5_000) for k, v in held[:15]], held[15:])
    assert renewed == [True] * 15 and released == [True] * 5
    assert CountingConnection.writes - before == 1
    assert all(leases.client.exists(k) == 0 for k, _ in held[15:])
    assert all(leases.client.pttl(k) > 4_000 for k, _ in held[:15])


def test_scripts_reload_after_script_flush(leases: LeaseStore) -> None:
    leases.claim("k", "t", 1_000)
    leases.client.script_flush()  # what a restart or failover does to the script cache
    g = leases.claim("k2", "t", 1_000)
    assert g == 1
    leases.client.script_flush()
    renewed, _ = leases.batch([(leases.keys_for("k2").lease, f"t:{g}", 1_000)], [])
    assert renewed == [True]


def test_redis_is_real(redis_client: redis.Redis) -> None:
    assert redis_client.ping()


def test_claim_carries_releases_in_the_same_round_trip(leases: LeaseStore) -> None:
    finished = []
    for i in range(3):
        g = leases.claim(f"done{i}", "old", 5_000)
        finished.append((leases.keys_for(f"done{i}").lease, f"old:{g}"))
    taken_over = leases.keys_for("done2").lease
    leases.client.set(taken_over, "newer:9")  # one of them now belongs to someone else
    kwargs = leases.client.connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=CountingConnection, **kwargs)
    counted = LeaseStore(redis.Redis(connection_pool=pool), prefix=leases.prefix)
    counted.client.ping()
    before = CountingConnection.writes
    g = counted.claim("next", "tok", 5_000, releases=finished)
    assert CountingConnection.writes - before == 1
    assert g == 1
    assert [leases.client.exists(k) for k, _ in finished[:2]] == [0, 0]
    assert leases.client.get(taken_over) == b"newer:9"  # compared, not deleted


_BUSY_LUA = """
local start = redis.call('TIME')
local function ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
while ms(redis.call('TIME')) - ms(start) < tonumber(ARGV[1]) do end
return 1
"""


@pytest.fixture
def impatient_leases(redis_client: redis.Redis, prefix: str) -> Iterator[LeaseStore]:
    """Leases on a client that gives up on a reply after 0.1 s (redis-py would re-send on
    timeout), its script loaded and a connection open."""
    kwargs = redis_client.connection_pool.connection_kwargs
    impatient = redis.Redis(
        host=kwargs["host"], port=kwargs["port"], db=kwargs["db"], socket_timeout=0.1
    )
    leases = LeaseStore(impatient, prefix=prefix)
    leases.claim("warm-up", "w", 10_000)
    yield leases
    impatient.close()


@contextmanager
def _stalled(redis_client: redis.Redis, ms: int) -> Iterator[None]:
    """Redis busy for ``ms`` milliseconds (a busy script) around the block; ends after it."""
    stall = threading.Thread(target=redis_client.eval, args=(_BUSY_LUA, 0, ms))
    stall.start()
    time.sleep(0.1)
    try:
        yield
    finally:
        stall.join()  # the stall ends; Redis runs what it received


@pytest.mark.parametrize("with_releases", [False, True])
def test_a_claim_whose_reply_is_late_is_sent_once_not_retried(
    redis_client: redis.Redis, impatient_leases: LeaseStore, prefix: str, with_releases: bool
) -> None:
    # Given an impatient client,
    leases = impatient_leases
    keys = leases.keys_for("report:7")
    releases = [(f"{prefix}:other:lease", "gone:1")] if with_releases else []
    # When Redis stalls for 0.6 s while the claim is in flight,
    with _stalled(redis_client, 600):
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            leases.claim("report:7", "A", 10_000, releases=releases)
        assert time.monotonic() - started < 0.5  # raised at the timeout, not after retries
    time.sleep(0.2)
    # Then the claim ran exactly once: one generation, one lease, and the caller saw the
    # timeout (redis-py's own retry re-sends it, meets the lease it just took and says busy).
    assert int(redis_client.get(keys.generation) or 0) == 1
    assert redis_client.get(keys.lease) == b"A:1"


def test_a_token_release_takes_that_attempts_lease_whatever_its_generation(
    leases: LeaseStore,
) -> None:
    lease_key = leases.keys_for("report:8").lease
    g = leases.claim("report:8", "A", 10_000)
    # "<token>:" without the generation: the release of a claim whose reply was lost.
    assert leases.release(lease_key, "B:") is False  # another attempt's token: kept
    assert leases.release(lease_key, "A") is False  # not a token release: exact compare
    assert leases.client.get(lease_key) == f"A:{g}".encode()
    assert leases.release(lease_key, "A:") is True
    assert leases.client.get(lease_key) is None
    # and carried by a claim, in the claim's own round trip
    g2 = leases.claim("report:8", "B", 10_000)
    g3 = leases.claim("report:9", "C", 10_000, releases=[(lease_key, "B:")])
    assert leases.client.get(lease_key) is None and g3 >= 1 and g2 == g + 1


def test_after_a_lost_claim_reply_the_token_release_frees_the_key_at_once(
    redis_client: redis.Redis, impatient_leases: LeaseStore
) -> None:
    leases = impatient_leases
    with _stalled(redis_client, 500), pytest.raises(redis.exceptions.TimeoutError):
        leases.claim("report:10", "A", 30_000)  # the claim ran; its reply was lost
    # What FencedTask queues after such an error, carried by the next claim: the re-sent
    # attempt claims at once instead of finding "A"'s lease busy for 30 s.
    lease_key = leases.keys_for("report:10").lease
    assert leases.claim("report:10", "B", 30_000, releases=[(lease_key, "A:")]) == 2
    assert redis_client.get(lease_key) == b"B:2"


def test_the_claims_share_one_written_part_and_redis_is_sent_it_inlined() -> None:
    from celery_fence.leases import lease, limits
    from celery_fence.leases.scripts import INCLUDE, _read

    part = _read("_claim_parts")
    for script in (lease.CLAIM, limits.CLAIM_IN_GROUP):
        assert INCLUDE + "_claim_parts" in _read(script.name)  # written once, included
        assert part in script.source and INCLUDE not in script.source  # sent whole
