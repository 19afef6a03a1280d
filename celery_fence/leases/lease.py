"""The Redis side: claim, renew, release and raise-generation, each one Lua script.

Redis is a liveness hint here, not the authority: the SQL store fences every write on the
generation, so a Redis restart or failover that loses a counter or a lease costs availability
(a retry), never correctness.

Key layout for a logical key K (both keys share one Redis Cluster hash tag, so a script touches
one slot; the tag is a digest of K, so any user string is safe)::

    <prefix>:{<digest(K)>}:lease   "<token>:<generation>" with a PX expiry
    <prefix>:{<digest(K)>}:gen     integer generation counter, expiring ``generation_ttl`` after
                                   its last claim (the SQL store raises one that came back low)
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from celery_fence.errors import LeaseBusy, LeaseLost
from celery_fence.leases.redis_client import RedisSettings, make_client
from celery_fence.leases.scripts import LuaScript

logger = logging.getLogger(__name__)

CLAIMED, BUSY = 1, 0

#: Seconds a generation counter lives in Redis after its last claim (0: never expires). The SQL
#: store is the authority on generations, so an expired counter costs one raised counter (a few
#: round trips) when its key is claimed again unfinished, never correctness. Ten minutes covers
#: the default backoff cap and recovery threshold; Redis then holds at most ten minutes' worth
#: of distinct keys.
DEFAULT_GENERATION_TTL = 600.0


CLAIM = LuaScript("claim")
RENEW = LuaScript("renew")
RELEASE = LuaScript("release")
RAISE_GENERATION = LuaScript("raise_generation")


def make_redis_client(settings: RedisSettings) -> Any:
    """The redis-py client for leases: ``fence_redis_client()`` when set, else from the settings
    (one Redis, TLS, unix socket, Sentinel or Cluster: see
    :mod:`celery_fence.leases.redis_client`)."""
    return make_client(settings)


@dataclass(frozen=True)
class LeaseKeys:
    lease: str
    generation: str


class HeldLease:
    """One lease held by one attempt: the attempt's view of its own authority.

    Its local deadline is the send time of the last confirmed renewal (or the claim) plus the TTL
    less the safety margin, capped by ``fence_max_runtime``; once the deadline passes
    unconfirmed, the lease is lost, whatever Redis says later. All times are monotonic seconds
    from ``clock``.
    """

    def __init__(
        self,
        *,
        key: str,
        lease_key: str,
        token: str,
        generation: int,
        ttl: float,
        interval: float,
        margin: float,
        claimed_at: float,
        on_lost: Callable[[HeldLease, str], None] | None = None,
        on_renewed: Callable[[HeldLease], None] | None = None,
        max_runtime: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key = key
        self.lease_key = lease_key
        self.token = token
        self.generation = generation
        self.value = f"{token}:{generation}"
        self.ttl = ttl
        self.ttl_ms = round(ttl * 1000)
        self.interval = interval
        self.margin = margin
        self.on_lost = on_lost
        self.on_renewed = on_renewed
        self._lock = threading.Lock()
        self._clock = clock  # monotonic seconds; injectable so the deadline logic is unit-tested
        #: ``fence_max_runtime``: past this monotonic time the lease is never renewed again (it
        #: frees itself one TTL after its last renewal) and ``check()`` raises.
        self.max_deadline = math.inf if max_runtime is None else claimed_at + max_runtime
        self.deadline = min(claimed_at + self._validity(), self.max_deadline)
        self.lost_reason: str | None = None

    def _validity(self) -> float:
        return self.ttl * (1.0 - self.margin)

    def confirm(self, sent_at: float) -> None:
        """A renewal sent at monotonic ``sent_at`` was confirmed by Redis."""
        with self._lock:
            if self.lost_reason is None:
                extended = max(self.deadline, sent_at + self._validity())
                self.deadline = min(extended, self.max_deadline)

    def remaining(self) -> float:
        return self.deadline - self._clock()

    def _expiry_reason(self) -> str:
        if self._clock() > self.max_deadline:
            return "fence_max_runtime exceeded: no longer renewed"
        return "deadline passed without a confirmed renewal"

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None or self._clock() > self.deadline

    def mark_lost(self, reason: str) -> bool:
        """Record the loss once; return True for the call that recorded it."""
        with self._lock:
            if self.lost_reason is not None:
                return False
            self.lost_reason = reason
        if self.on_lost is not None:
            try:
                self.on_lost(self, reason)
            except Exception:  # the loss is recorded; a failing observer must not hide it
                logger.exception("lease_lost observer failed for key=%s", self.key)
        return True

    def check(self) -> None:
        """Raise :class:`LeaseLost` once the lease is lost or its deadline passed unconfirmed.

        Decides from the local deadline itself: after a process pause the renewal thread and the
        task resume in either order, and the task must not trust a flag the thread did not set yet.
        """
        if self.lost_reason is None and self._clock() > self.deadline:
            self.mark_lost(self._expiry_reason())
        if self.lost_reason is not None:
            raise LeaseLost(
                f"lease lost for key {self.key!r} at generation {self.generation}: "
                f"{self.lost_reason}",
                key=self.key,
                generation=self.generation,
            )


def lease_keys(prefix: str, key: str) -> LeaseKeys:
    """The Redis keys of ``key``'s lease and generation counter under ``prefix``: one hash tag
    (a digest of the key), so both live in one Cluster slot."""
    tag = hashlib.blake2b(key.encode("utf-8"), digest_size=12).hexdigest()
    base = f"{prefix}:{{{tag}}}"
    return LeaseKeys(lease=f"{base}:lease", generation=f"{base}:gen")


class LeaseStore:
    """Lease operations against one Redis client. Safe to share between threads."""

    def __init__(
        self, client: Any, *, prefix: str, generation_ttl: float = DEFAULT_GENERATION_TTL
    ) -> None:
        self.client = client
        self.prefix = prefix
        #: milliseconds a generation counter lives after its last claim (0: forever)
        self.generation_ttl_ms = round(generation_ttl * 1000)

    @property
    def clustered(self) -> bool:
        """True on a Redis Cluster, where one script may only touch one hash slot."""
        return isinstance(self.client, RedisCluster)

    def keys_for(self, key: str) -> LeaseKeys:
        return lease_keys(self.prefix, key)

    def claim(
        self, key: str, token: str, ttl_ms: int, *, releases: Sequence[tuple[str, str]] = ()
    ) -> int:
        """Claim ``key`` for ``ttl_ms`` milliseconds; return the new generation.

        ``releases`` — (lease key, value) pairs of finished attempts — ride in the same round
        trip (compare-and-delete each), so releasing costs the critical path nothing.
        Raises :class:`LeaseBusy` (with ``remaining`` in seconds) when a live lease exists.
        """
        keys = self.keys_for(key)
        if releases and self.clustered:
            status, value = self._claim_with_releases(keys, token, ttl_ms, releases)
        else:  # one script call: the releases' keys may live anywhere on one Redis
            status, value = CLAIM.call_once(
                self.client,
                [keys.lease, keys.generation, *(lease_key for lease_key, _ in releases)],
                [token, ttl_ms, self.generation_ttl_ms, *(value for _, value in releases)],
            )
        if int(status) == CLAIMED:
            return int(value)
        remaining_ms = int(value)
        remaining = ttl_ms / 1000 if remaining_ms < 0 else remaining_ms / 1000
        raise LeaseBusy(f"lease for {key!r} is held by another attempt", remaining=remaining)

    def _claim_with_releases(
        self, keys: LeaseKeys, token: str, ttl_ms: int, releases: Sequence[tuple[str, str]]
    ) -> Any:
        calls: list[tuple[LuaScript, tuple[Any, ...]]] = [
            (RELEASE, (1, lease_key, value)) for lease_key, value in releases
        ]
        calls.append(
            (CLAIM, (2, keys.lease, keys.generation, token, ttl_ms, self.generation_ttl_ms))
        )
        result = self._pipelined(calls)[-1]
        if isinstance(result, Exception):
            raise result
        return result

    def _pipelined(self, calls: Sequence[tuple[LuaScript, tuple[Any, ...]]]) -> list[Any]:
        """Run (script, (numkeys, *keys, *args)) calls in one pipelined round trip (per node).

        A raw EVALSHA, not ``pipe.evalsha()``: a redis-py cluster pipeline refuses evalsha() but
        routes a raw EVALSHA by its key's slot, so one trip reaches every node at once (MOVED/ASK
        are followed by redis-py). Calls answered ``NOSCRIPT`` (restart, failover, a new cluster
        node) are re-sent once after loading their scripts — only those: a claim that succeeded
        is never sent twice. Errors are returned in place, not raised.
        """
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for i in pending:
                script, args = calls[i]
                pipe.execute_command("EVALSHA", script.sha, *args)
            for i, result in zip(pending, pipe.execute(raise_on_error=False), strict=True):
                results[i] = result
            pending = [i for i in pending if isinstance(results[i], NoScriptError)]
            if not pending or attempt == 2:
                break
            for script in {calls[i][0] for i in pending}:
                script.load(self.client)
        return results

    def raise_generation(self, key: str, floor: int) -> int:
        """Raise the generation counter to at least ``floor`` (set-if-greater); return it."""
        keys = self.keys_for(key)
        return int(
            RAISE_GENERATION(self.client, [keys.generation], [floor, self.generation_ttl_ms])
        )

    def take_generation(self, key: str) -> int:
        """Take the next generation of ``key`` without a lease (``INCR``); return it. A message
        that settles without running learns whether any claim came before it (above 1)."""
        counter = self.keys_for(key).generation
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(counter)
        if self.generation_ttl_ms > 0:
            pipe.pexpire(counter, self.generation_ttl_ms)
        return int(pipe.execute()[0])

    def release(self, lease_key: str, value: str) -> bool:
        """Compare-and-delete one lease; True when it was still ours."""
        return bool(RELEASE(self.client, [lease_key], [value]))

    def renew(self, lease_key: str, value: str, ttl_ms: int) -> bool:
        return bool(RENEW(self.client, [lease_key], [value, ttl_ms]))

    def batch(
        self,
        renewals: Sequence[tuple[str, str, int]],
        releases: Sequence[tuple[str, str]],
    ) -> tuple[list[bool], list[bool]]:
        """Renew and release many leases in one pipelined round trip.

        ``renewals`` are (lease key, value, ttl ms); ``releases`` are (lease key, value).
        Returns one bool per renewal (still ours) and per release (deleted).
        """
        if not renewals and not releases:
            return [], []
        calls: list[tuple[LuaScript, tuple[Any, ...]]] = [
            (RENEW, (1, lease_key, value, ttl_ms)) for lease_key, value, ttl_ms in renewals
        ] + [(RELEASE, (1, lease_key, value)) for lease_key, value in releases]
        results = self._pipelined(calls)
        for r in results:
            if isinstance(r, Exception):
                raise r
        flags = [bool(r) for r in results]
        return flags[: len(renewals)], flags[len(renewals) :]

    def held(self, keys: Sequence[str]) -> set[str]:
        """Which of ``keys`` a live lease holds (as :meth:`remaining` judges one), in one
        pipelined round trip."""
        if not keys:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(self.keys_for(key).lease)
        return {key for key, pttl in zip(keys, pipe.execute(), strict=True) if pttl >= 0}

    def remaining_many(self, keys: Sequence[str]) -> dict[str, tuple[float, int | None]]:
        """The live leases among ``keys``: key -> (seconds left, the lease's generation), in one
        pipelined round trip (a PTTL and a GET per key); a key without a live lease is absent."""
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            lease = self.keys_for(key).lease
            pipe.pttl(lease)
            pipe.get(lease)
        replies = pipe.execute()
        live: dict[str, tuple[float, int | None]] = {}
        for i, key in enumerate(keys):
            pttl, value = replies[2 * i], replies[2 * i + 1]
            if value is not None and pttl >= 0:
                live[key] = (pttl / 1000, _generation_of(value))
        return live

    def remaining(self, key: str) -> tuple[float | None, int | None]:
        """(seconds left on the live lease or None, the lease's generation or None)."""
        keys = self.keys_for(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.pttl(keys.lease)
        pipe.get(keys.lease)
        pttl, value = pipe.execute()
        if value is None or pttl < 0:
            return None, None
        return pttl / 1000, _generation_of(value)


def _generation_of(value: Any) -> int | None:
    """The generation in a lease value ``<token>:<generation>`` (None when it is not one)."""
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes):
        return None
    try:
        return int(value.rsplit(b":", 1)[1])
    except (IndexError, ValueError):
        return None
