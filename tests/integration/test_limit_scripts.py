"""The limit scripts against a real Redis: a group's slots (taken, full, renewed and released as
leases, freed by expiry) and the rate limit's token bucket; the settings that name them."""

from __future__ import annotations

import itertools
import time

import pytest
import redis

from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError
from celery_fence.leases.lease import LeaseStore
from celery_fence.leases.limits import Limits, Rate, Slot, parse_rate, slot_keys


@pytest.fixture
def limits(redis_client: redis.Redis, prefix: str) -> Limits:
    return Limits(redis_client, prefix=prefix)


def test_a_group_hands_out_its_slots_then_reports_the_soonest_expiry(limits: Limits) -> None:
    taken = [limits.claim_slot("g", 3, f"tok-{i}", 5_000) for i in range(3)]
    assert [s.index for s in taken if isinstance(s, Slot)] == [1, 2, 3]
    full = limits.claim_slot("g", 3, "tok-x", 5_000)
    assert isinstance(full, float) and 4.0 < full <= 5.0
    assert limits.held_slots("g", 3) == 3
    # another group is independent
    assert isinstance(limits.claim_slot("other", 3, "tok-y", 5_000), Slot)


def test_a_slot_is_a_lease_renewed_and_released_by_its_token_only(
    limits: Limits, redis_client: redis.Redis, prefix: str
) -> None:
    leases = LeaseStore(redis_client, prefix=prefix)
    slot = limits.claim_slot("g", 1, "tok-a", 1_000)
    assert isinstance(slot, Slot)
    assert leases.renew(slot.lease_key, slot.value, 5_000)
    assert redis_client.pttl(slot.lease_key) > 4_000
    assert not leases.release(slot.lease_key, "tok-b:1")  # not its holder: nothing removed
    assert isinstance(limits.claim_slot("g", 1, "tok-b", 1_000), float)
    assert leases.release(slot.lease_key, slot.value)
    assert isinstance(limits.claim_slot("g", 1, "tok-b", 1_000), Slot)


def test_a_dead_holders_slot_frees_itself_at_its_ttl(limits: Limits) -> None:
    assert isinstance(limits.claim_slot("g", 1, "tok-a", 100), Slot)
    assert isinstance(limits.claim_slot("g", 1, "tok-b", 100), float)
    time.sleep(0.15)
    assert isinstance(limits.claim_slot("g", 1, "tok-b", 100), Slot)


def test_the_bucket_grants_its_burst_then_spaces_the_refused_one_token_apart(
    limits: Limits,
) -> None:
    rate = parse_rate("10/s")  # capacity 10, one token every 100 ms
    assert [limits.take_token("b", rate) for _ in range(10)] == [0.0] * 10
    waits = [limits.take_token("b", rate) for _ in range(5)]
    assert all(w > 0 for w in waits)
    steps = [b - a for a, b in itertools.pairwise(waits)]
    assert all(0.08 <= s <= 0.12 for s in steps), waits  # promised one after another
    time.sleep(0.25)
    assert limits.take_token("b", rate) == 0.0  # refilled at the rate


@pytest.mark.parametrize(
    ("text", "count", "period"),
    [("10/s", 10, 1), ("100/m", 100, 60), ("1000/h", 1000, 3600), (" 2.5 / s ", 2.5, 1)],
)
def test_rate_strings(text: str, count: float, period: float) -> None:
    rate = parse_rate(text)
    assert (rate.count, rate.period) == (count, period)
    assert isinstance(rate, Rate)


@pytest.mark.parametrize("bad", ["10", "10/d", "0/s", "-1/s", "ten/s", 10, None])
def test_a_bad_rate_string_names_the_format(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"'<count>/<unit>'.*'10/s', '100/m'"):
        parse_rate(bad)


def test_limit_settings_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="fence_rate_limit='fast'"):
        FenceConfig.from_mapping({"fence_rate_limit": "fast"})
    with pytest.raises(ConfigurationError, match="needs a group: set fence_group"):
        FenceConfig.from_mapping({"fence_group_limit": 3})
    with pytest.raises(ConfigurationError, match="fence_group_limit=0 must be an int from 1"):
        FenceConfig.from_mapping({"fence_group": "g", "fence_group_limit": 0})
    config = FenceConfig.from_mapping({"fence_group": "g", "fence_group_limit": "3"})
    assert config.group_limit == 3 and config.rate is None


def test_a_slot_claim_carries_finished_attempts_releases_compared_on_their_values(
    limits: Limits, redis_client: redis.Redis
) -> None:
    first = limits.claim_slot("g", 1, "tok-a", 5_000)
    assert isinstance(first, Slot)
    # a wrong value releases nothing: the group stays full
    assert isinstance(
        limits.claim_slot("g", 1, "tok-b", 5_000, releases=[(first.lease_key, "tok-x:1")]), float
    )
    # the finished attempt's own value frees its slot in the same round trip, for the claimer
    second = limits.claim_slot("g", 1, "tok-b", 5_000, releases=[(first.lease_key, first.value)])
    assert isinstance(second, Slot) and second.index == 1
    assert redis_client.get(second.lease_key) == b"tok-b:1"


def test_a_claim_in_group_takes_the_key_and_a_slot_in_one_trip_and_a_busy_key_no_slot(
    limits: Limits, redis_client: redis.Redis, prefix: str
) -> None:
    leases = LeaseStore(redis_client, prefix=prefix)
    k1, k2, k3 = leases.keys_for("k1"), leases.keys_for("k2"), leases.keys_for("k3")
    # Given a group of 2 slots: the first claim takes key k1 (generation 1) and a slot,
    first = limits.claim_in_group(k1.lease, k1.generation, "g", 2, "a1", 5_000, 0)
    assert first.status == "claimed" and first.generation == 1 and first.slot is not None
    assert first.slot.value == f"a1/slot:{first.slot.index}"
    assert first.slot.lease_key in slot_keys(limits.prefix, "g", 2)
    assert redis_client.get(k1.lease) == b"a1:1"
    assert redis_client.get(first.slot.lease_key) == first.slot.value.encode()
    assert 4_000 < redis_client.pttl(first.slot.lease_key) <= 5_000
    # a second attempt of k1 finds the key busy and takes no slot,
    busy = limits.claim_in_group(k1.lease, k1.generation, "g", 2, "a2", 5_000, 0)
    assert busy.status == "busy" and 4.0 < busy.wait <= 5.0 and busy.slot is None
    assert limits.held_slots("g", 2) == 1
    # k2 takes the other slot; k3 finds the group full: nothing taken, no generation counted,
    second = limits.claim_in_group(k2.lease, k2.generation, "g", 2, "b1", 5_000, 0)
    assert second.status == "claimed" and second.slot is not None
    assert {first.slot.index, second.slot.index} == {1, 2}
    full = limits.claim_in_group(k3.lease, k3.generation, "g", 2, "c1", 5_000, 0)
    assert full.status == "full" and 4.0 < full.wait <= 5.0
    assert redis_client.get(k3.lease) is None and redis_client.get(k3.generation) is None
    # and a finished attempt's releases (its lease and its slot) ride in the next claim's trip.
    releases = [(k1.lease, "a1:1"), (first.slot.lease_key, first.slot.value)]
    again = limits.claim_in_group(
        k3.lease, k3.generation, "g", 2, "c2", 5_000, 60_000, releases=releases
    )
    assert again.status == "claimed" and again.slot is not None
    assert again.slot.index == first.slot.index
    assert redis_client.get(k1.lease) is None
    assert 0 < redis_client.pttl(k3.generation) <= 60_000
