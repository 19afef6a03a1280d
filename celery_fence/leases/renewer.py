"""The heartbeat: one daemon thread per worker process renews every lease the process holds.

Each tick sends one pipelined round trip to Redis, whatever the number of leases, carrying the
renewals and any pending releases. Every :class:`HeldLease` keeps a local monotonic deadline: the
send time of its last confirmed renewal plus the TTL minus a safety margin. Once that passes
unconfirmed, the lease is lost, ``check()`` raises, and the owner is told through ``on_lost`` —
a failing renewal is never silent (python-redis-lock's issue #85 is the counter-example).

The thread starts lazily in the process that holds leases (prefork children included); its
lifecycle is every background thread's (:mod:`celery_fence.process.background`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from celery_fence import metrics
from celery_fence.actions import LogAction
from celery_fence.leases.lease import HeldLease
from celery_fence.process.background import Background

if TYPE_CHECKING:
    from celery_fence.leases.ports import LeaseBackend

logger = logging.getLogger("celery_fence.renewer")

#: Seconds a finished attempt's release may wait for the next claim to carry it (in the same
#: round trip) before the renewer thread sends it on its own.
RELEASE_DELAY = 0.02

RENEWER_THREAD_NAME = "celery-fence-renewer"

#: Seconds before the thread re-sends releases whose round trip failed (Redis down or slow).
RELEASE_RETRY_DELAY = 1.0

#: Releases kept for re-sending while Redis cannot be reached.
MAX_PENDING_RELEASES = 10_000


class Renewer(Background):
    """Renews held leases and flushes releases, one pipelined round trip per tick."""

    thread_name = RENEWER_THREAD_NAME

    def __init__(self, leases: LeaseBackend) -> None:
        super().__init__()
        self.leases = leases
        self._cond = threading.Condition(threading.Lock())
        self._held: dict[str, HeldLease] = {}
        self._releases: list[tuple[str, str]] = []
        self._release_due = 0.0
        self._wake_at = math.inf  # when the thread's current wait ends (inf: idle)
        self._tick = math.inf  # the renewal interval the thread is using
        self._stopping = False
        self.ticks = 0  # round trips sent (for tests and the benchmark)

    def add(self, lease: HeldLease) -> None:
        with self._cond:
            self._held[lease.value] = lease
            if not self._start_locked() and (
                self._wake_at == math.inf or lease.interval < self._tick
            ):
                # Wake the thread only when its plan changes (it was idle, or this lease needs
                # a shorter tick): a wake-up per task is a thread switch in the task's way.
                self._cond.notify()

    def _start_locked(self) -> bool:
        """Start the thread if it is not running (the caller holds the lock); True if started."""
        if self.running:
            return False
        self._stopping = False
        return self.start()

    def discard(self, lease: HeldLease, *, release: bool = True) -> None:
        """Stop renewing ``lease``; queue its compare-and-delete (sent with the next claim, or by
        the thread within ``RELEASE_DELAY``)."""
        with self._cond:
            self._held.pop(lease.value, None)
            if release:
                if not self._releases:
                    self._release_due = time.monotonic() + RELEASE_DELAY
                self._releases.append((lease.lease_key, lease.value))
                if self._wake_at > self._release_due:  # it would sleep past the release's due
                    self._cond.notify()

    def take_releases(self) -> list[tuple[str, str]]:
        """Hand queued releases to the caller, which sends them with its next claim."""
        with self._cond:
            releases, self._releases = self._releases, []
            return releases

    @property
    def pending_releases(self) -> list[tuple[str, str]]:
        """The releases waiting to be sent (a copy)."""
        with self._cond:
            return list(self._releases)

    def return_releases(
        self, releases: list[tuple[str, str]], *, delay: float = RELEASE_DELAY
    ) -> None:
        """Give back releases a claim or a round trip could not send; they go with the next
        claim, or from the thread after ``delay`` seconds. At most ``MAX_PENDING_RELEASES`` are
        kept (the oldest go first: an unreleased lease still ends at its TTL)."""
        if releases:
            with self._cond:
                if not self._releases:
                    self._release_due = time.monotonic() + delay
                self._releases.extend(releases)
                del self._releases[:-MAX_PENDING_RELEASES]
                if threading.current_thread() is not self._thread:
                    self._start_locked()
                self._cond.notify()

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until queued releases were sent (tests, worker shutdown)."""
        end = time.monotonic() + timeout
        with self._cond:
            self._release_due = 0.0
        while time.monotonic() < end:
            with self._cond:
                if not self._releases:
                    return
                self._cond.notify()
            time.sleep(0.005)

    def shutdown(self, timeout: float) -> None:
        """Send the queued releases, then stop the thread (a worker process that exits)."""
        self.flush(timeout)
        self.stop()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.join(5.0)

    def _interval(self) -> float:
        return min((lease.interval for lease in self._held.values()), default=1.0)

    def _run(self) -> None:
        self._tick = self._interval()
        next_renewal = time.monotonic() + self._tick
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    renew_due = bool(self._held) and now >= next_renewal
                    release_due = bool(self._releases) and now >= self._release_due
                    if self._stopping or renew_due or release_due:
                        break
                    if self._held and self._interval() < self._tick:  # a shorter tick arrived
                        self._tick = self._interval()
                        next_renewal = min(next_renewal, now + self._tick)
                    wake = [next_renewal] if self._held else []
                    if self._releases:
                        wake.append(self._release_due)
                    self._wake_at = min(wake, default=math.inf)
                    if wake:
                        self._cond.wait(max(0.0, self._wake_at - now))
                    else:  # idle until a lease is added or a release queued
                        self._cond.wait()
                        self._tick = self._interval()
                        next_renewal = time.monotonic() + self._tick
                self._wake_at = 0.0  # awake: nobody needs to notify
                expired: list[HeldLease] = []  # past fence_max_runtime: not renewed any more
                releases: list[tuple[str, str]] = []
                if release_due or self._stopping:
                    releases, self._releases = self._releases, []
                held: list[HeldLease] = []
                if renew_due:
                    now = time.monotonic()
                    held = [lease for lease in self._held.values() if now < lease.max_deadline]
                    for lease in self._held.values():
                        if now >= lease.max_deadline and lease.lost_reason is None:
                            expired.append(lease)
                    self._tick = self._interval()
                    next_renewal = time.monotonic() + self._tick
                stopping = self._stopping
            for lease in expired:  # outside the lock: the observer may log and signal
                lease.mark_lost("fence_max_runtime exceeded: no longer renewed")
            if held or releases:
                self._trip(held, releases)
            if stopping:
                return

    def _trip(self, held: list[HeldLease], releases: list[tuple[str, str]]) -> None:
        sent_at = time.monotonic()
        try:
            renewed, _ = self.leases.batch(
                [(lease.lease_key, lease.value, lease.ttl_ms) for lease in held], releases
            )
        except Exception as exc:  # Redis down or slow: the deadlines decide, loudly
            # Releases are kept for the next claim or trip: a lease left behind would make the
            # key's next attempt wait out its TTL.
            self.return_releases(releases, delay=RELEASE_RETRY_DELAY)
            if not held:  # only releases: they are retried each second, quietly
                logger.info(
                    "lease release round trip failed (%s); %d release(s) kept for the next try",
                    type(exc).__name__,
                    len(releases),
                    extra={"action": LogAction.RELEASE_FAILED, "reason": type(exc).__name__},
                )
                return
            logger.warning(
                "lease renewal round trip failed (%s: %s); %d lease(s) will be lost at their "
                "deadline unless a renewal is confirmed",
                type(exc).__name__,
                exc,
                len(held),
                extra={"action": LogAction.RENEW_FAILED, "reason": type(exc).__name__},
            )
            for lease in held:
                if time.monotonic() > lease.deadline:
                    lease.mark_lost(f"renewal failed ({type(exc).__name__}) past the deadline")
            return
        finally:
            self.ticks += 1
        observer = metrics.active
        if observer is not None and held:
            observer.renewed(time.monotonic() - sent_at)
        for lease, ok in zip(held, renewed, strict=True):
            if ok:
                lease.confirm(sent_at)
                if lease.on_renewed is not None:
                    try:
                        lease.on_renewed(lease)
                    except Exception:
                        logger.exception("lease_renewed observer failed for key=%s", lease.key)
            else:
                lease.mark_lost("lease expired or taken over in Redis")


__all__ = ["HeldLease", "Renewer"]
