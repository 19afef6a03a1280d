"""The recovery check every fenced worker runs itself: a frozen or dead worker's ``running`` job
is taken over within one check (half a TTL) of its lease's end, whether or not beat schedules
``celery_fence.recover``.

One daemon thread in the worker's main process (started when the worker is ready, stopped with
the process's other background threads: :mod:`celery_fence.process.background`), so one per
worker, whatever its pool and concurrency. Every ``fence_recover_interval`` seconds (default:
half the lease TTL), with jitter (a wait drawn between half the interval and the whole of it), it
takes a short Redis throttle ``<prefix>:recover:check`` (``SET NX PX``, about one interval) and,
when it got it, runs one :func:`~celery_fence.ops.recovery.recover` on the worker's app. N
workers thus scan about once per interval between them, not N times; the throttle is an
economy only: two checks that run at once still re-send a job once, since the re-send's
compare-and-set (``take_for_resend``) lets one of them take the row.

A check that fails (Redis or the database unreachable) is logged and tried again at the next
interval; it never stops the worker.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from typing import Any

from celery_fence.actions import LogAction
from celery_fence.config import FenceConfig
from celery_fence.leases.lease import make_redis_client
from celery_fence.ops.recovery import recover
from celery_fence.process.background import Background
from celery_fence.process.runtime import runtime

logger = logging.getLogger("celery_fence.recovery")

RECOVERY_THREAD_NAME = "celery-fence-recover"
#: The Redis key (under ``fence_key_prefix``) that lets one worker's check run per interval.
THROTTLE_KEY = "recover:check"


class RecoveryThread(Background):
    """Runs :func:`~celery_fence.ops.recovery.recover` on ``app`` every ``interval`` seconds
    (jittered, throttled across workers by Redis)."""

    thread_name = RECOVERY_THREAD_NAME

    def __init__(self, app: Any, config: FenceConfig, *, owner: str = "") -> None:
        super().__init__()
        self.app = app
        self.config = config
        self.interval = config.recover_interval_seconds
        self.owner = owner or "worker"
        self._stop = threading.Event()
        self._client: Any = None
        #: Checks this thread ran (tests and ``py-spy`` readers).
        self.checks = 0

    def wait(self) -> float:
        """The next wait: between half the interval and all of it."""
        return self.interval * random.uniform(0.5, 1.0)

    def throttle(self) -> bool:
        """True when this worker may run the check now (no other did within the interval)."""
        if self._client is None:
            self._client = make_redis_client(self.config.redis)
        key = f"{self.config.key_prefix}:{THROTTLE_KEY}"
        ms = max(1, int(self.interval * 1000 * 0.9))
        return bool(self._client.set(key, self.owner, nx=True, px=ms))

    def check(self) -> None:
        """One check: the throttle, then one recovery run (never raises)."""
        try:
            if not self.throttle():
                logger.debug("fence recovery check: another worker checked within the interval")
                return
            self.checks += 1
            report = recover(self.app)
        except Exception as exc:
            logger.warning(
                "fence recovery check failed: %s (next check in about %gs)",
                type(exc).__name__,
                self.interval,
                extra={"action": LogAction.RECOVER_FAILED, "reason": type(exc).__name__},
            )
            return
        if report.sent or report.dead or report.failed:
            logger.info(
                "fence recovery check: %s",
                report.as_dict(),
                extra={"action": LogAction.RECOVER_CHECK, "reason": "stranded jobs"},
            )

    def _run(self) -> None:
        logger.info(
            "fence recovery checks every %gs (jittered) in this worker",
            self.interval,
            extra={"action": LogAction.RECOVER_CHECK, "reason": "started"},
        )
        while not self._stop.wait(self.wait()):
            self.check()

    def shutdown(self, timeout: float) -> None:
        self._stop.set()
        self.join(timeout)
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


def start_recovery_thread(app: Any, owner: str = "") -> RecoveryThread | None:
    """Start ``app``'s recovery thread in this process (once); None when
    ``fence_recover_interval`` is 0."""
    config = FenceConfig.from_app(app)
    if config.recover_interval_seconds <= 0:
        return None
    thread = runtime().get("recover", id(app), lambda: RecoveryThread(app, config, owner=owner))
    thread.start()
    return thread


__all__ = ["RECOVERY_THREAD_NAME", "THROTTLE_KEY", "RecoveryThread", "start_recovery_thread"]
