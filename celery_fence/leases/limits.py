"""Cluster-wide limits, each one Lua script on the lease Redis: concurrency groups
(``fence_group`` / ``fence_group_limit``) and rate limits (``fence_rate_limit``).

Key layout (each limit's keys share one Redis Cluster hash tag, a digest of its name)::

    <prefix>:{g<digest(group)>}:slot:<i>   i = 1..limit: one lease per slot, "<token>:<i>" PX
    <prefix>:{r<digest(bucket)>}:rate      the token bucket, a hash {tokens, ts, promised}

A group's slot is a lease like a key's: renewed by the process's renewal thread in the same
round trip as the key's lease, released by compare-and-delete (``release.lua``), and, when its
worker dies, free again one TTL after its last renewal. Over a limit, nothing waits in the
worker: the message is re-sent with a countdown (the settle step's ``group_full`` and
``rate_limited`` re-sends), never dropped and never counted as an attempt.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster

from celery_fence.errors import ConfigurationError
from celery_fence.leases.scripts import LuaScript

GROUP_CLAIM = LuaScript("group_claim")
CLAIM_IN_GROUP = LuaScript("claim_in_group")
RATE_TAKE = LuaScript("rate_take")

#: The largest ``fence_group_limit``: the claim script tries every slot in turn.
MAX_GROUP_LIMIT = 1000

_UNITS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hour": 3600.0}
_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*([a-z]+)\s*")


@dataclass(frozen=True)
class Rate:
    """A parsed ``fence_rate_limit``: ``count`` tasks per ``period`` seconds."""

    count: float
    period: float
    text: str

    @property
    def per_second(self) -> float:
        return self.count / self.period

    @property
    def capacity(self) -> float:
        """The bucket's size (its burst): one second's worth of tokens, at least one."""
        return max(1.0, self.per_second)


def parse_rate(raw: Any, setting: str = "fence_rate_limit") -> Rate:
    """``"100/m"``, ``"10/s"``, ``"1000/h"`` as a :class:`Rate`; a clear error otherwise."""
    match = _RATE.fullmatch(raw) if isinstance(raw, str) else None
    if match is None or match.group(2) not in _UNITS or not float(match.group(1)) > 0:
        raise ConfigurationError(
            f"{setting}={raw!r} is not a rate: write '<count>/<unit>' with a positive count and "
            "a unit s, m or h, e.g. '10/s', '100/m' or '1000/h'"
        )
    return Rate(float(match.group(1)), _UNITS[match.group(2)], raw.strip())


def _tag(kind: str, name: str) -> str:
    return kind + hashlib.blake2b(name.encode("utf-8"), digest_size=12).hexdigest()


def slot_base(prefix: str, group: str) -> str:
    """The base name of ``group``'s slot keys: slot ``i`` is ``<base>:<i>`` (one hash tag)."""
    return f"{prefix}:{{{_tag('g', group)}}}:slot"


def slot_keys(prefix: str, group: str, limit: int) -> list[str]:
    """The Redis keys of ``group``'s ``limit`` slots (one hash tag)."""
    base = slot_base(prefix, group)
    return [f"{base}:{i}" for i in range(1, limit + 1)]


def bucket_key(prefix: str, bucket: str) -> str:
    """The Redis key of a rate limit's token bucket (``bucket``: the group, or the task name)."""
    return f"{prefix}:{{{_tag('r', bucket)}}}:rate"


@dataclass(frozen=True)
class Slot:
    """A group slot taken by one attempt: a lease on ``lease_key`` whose value is ``value``."""

    lease_key: str
    token: str
    index: int

    @property
    def value(self) -> str:
        return f"{self.token}:{self.index}"


@dataclass(frozen=True)
class GroupClaim:
    """What :meth:`Limits.claim_in_group` answered: ``status`` ``"claimed"`` (with the key's new
    ``generation`` and the group's ``slot``), ``"busy"`` (the key's lease is live for ``wait``
    more seconds) or ``"full"`` (every slot is held; the soonest frees in ``wait`` seconds).
    Only a claimed answer took anything."""

    status: str
    generation: int = 0
    slot: Slot | None = None
    wait: float = 0.0


class Limits:
    """The limit scripts against one Redis client (the leases' own: Sentinel, Cluster alike).
    Safe to share between threads. Times returned are seconds."""

    def __init__(self, client: Any, *, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    @property
    def carries_releases(self) -> bool:
        """Whether a slot claim can carry releases of any key (not on a Redis Cluster, where a
        script touches one hash slot)."""
        return not isinstance(self.client, RedisCluster)

    def claim_slot(
        self,
        group: str,
        limit: int,
        token: str,
        ttl_ms: int,
        *,
        releases: Sequence[tuple[str, str]] = (),
    ) -> Slot | float:
        """Take a free slot of ``group`` for ``ttl_ms`` milliseconds: the :class:`Slot`, or, when
        all ``limit`` are held, the seconds until the soonest of them expires (the TTL when one
        has no expiry). ``releases`` — (lease key, value) pairs of finished attempts, only where
        :attr:`carries_releases` — are compare-and-deleted first, in the same round trip."""
        keys = slot_keys(self.prefix, group, limit)
        status, value = GROUP_CLAIM.call_once(
            self.client,
            [*keys, *(lease_key for lease_key, _ in releases)],
            [token, ttl_ms, limit, *(value for _, value in releases)],
        )
        if int(status) == 1:
            return Slot(keys[int(value) - 1], token, int(value))
        soonest = int(value)
        return ttl_ms / 1000 if soonest < 0 else soonest / 1000

    def claim_in_group(
        self,
        lease_key: str,
        generation_key: str,
        group: str,
        limit: int,
        token: str,
        ttl_ms: int,
        generation_ttl_ms: int,
        *,
        releases: Sequence[tuple[str, str]] = (),
    ) -> GroupClaim:
        """Claim a key (its ``lease_key`` and ``generation_key``, as ``claim.lua`` does) and a
        free slot of ``group`` in one round trip, only where :attr:`carries_releases` (the key
        and the slots carry different hash tags, and the script builds the slot keys from their
        base name rather than receive ``limit`` of them). The key is checked first: a busy key
        takes no slot. The slot's owner token is ``"<token>/slot"`` (as :meth:`claim_slot`'s
        callers name it), its TTL the lease's. ``releases`` ride in the same trip."""
        base = slot_base(self.prefix, group)
        start = random.randrange(limit)  # not a secret: where the scan for a free slot begins
        status, value, index = CLAIM_IN_GROUP.call_once(
            self.client,
            [lease_key, generation_key, *(key for key, _ in releases)],
            [token, ttl_ms, generation_ttl_ms, limit, f"{token}/slot", base, start]
            + [value for _, value in releases],
        )
        code, number = int(status), int(value)
        if code == 1:
            slot = Slot(f"{base}:{int(index)}", f"{token}/slot", int(index))
            return GroupClaim("claimed", generation=number, slot=slot)
        wait = ttl_ms / 1000 if number < 0 else number / 1000
        return GroupClaim("busy" if code == 0 else "full", wait=wait)

    def take_token(self, bucket: str, rate: Rate) -> float:
        """Take one token from ``bucket``: 0.0 when taken, else the seconds until this caller
        should come back (the refused are spaced one token apart)."""
        status, wait_ms = RATE_TAKE.call_once(
            self.client, [bucket_key(self.prefix, bucket)], [rate.per_second, rate.capacity]
        )
        return 0.0 if int(status) == 1 else max(int(wait_ms), 1) / 1000

    def held_slots(self, group: str, limit: int) -> int:
        """How many of ``group``'s slots are held now (operators, tests)."""
        pipe = self.client.pipeline(transaction=False)
        for key in slot_keys(self.prefix, group, limit):
            pipe.exists(key)
        return sum(int(n) for n in pipe.execute())


__all__ = [
    "MAX_GROUP_LIMIT",
    "GroupClaim",
    "Limits",
    "Rate",
    "Slot",
    "bucket_key",
    "parse_rate",
    "slot_base",
    "slot_keys",
]
