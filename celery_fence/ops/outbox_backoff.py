"""The outbox's backoff between failed deliveries of an effect ("equal jitter", capped): retry
``n`` waits ``uniform(c / 2, c)`` seconds, ``c = min(fence_outbox_backoff_max,
fence_outbox_backoff * 2 ** (n - 1))``, until ``fence_outbox_max_attempts`` deliveries failed
(:func:`dead_after`: how long that takes). The delivery that applies it is
:class:`celery_fence.ops.outbox.Outbox`."""

from __future__ import annotations

import random

from celery_fence.config import FenceConfig

__all__ = ["dead_after", "retry_ceiling", "retry_delay"]


def retry_ceiling(attempt: int, config: FenceConfig) -> float:
    """The longest wait, in seconds, after an effect's failed delivery number ``attempt``
    (1-based): ``min(fence_outbox_backoff_max, fence_outbox_backoff * 2 ** (attempt - 1))``."""
    exponent = min(max(0, attempt - 1), 64)
    return min(config.outbox_backoff_max, config.outbox_backoff * (2.0**exponent))


def retry_delay(attempt: int, config: FenceConfig, rng: random.Random | None = None) -> float:
    """The wait after failed delivery number ``attempt``: ``uniform(ceiling / 2, ceiling)``."""
    top = retry_ceiling(attempt, config)
    return (rng or random).uniform(top / 2, top)


def dead_after(config: FenceConfig) -> tuple[float, float]:
    """The shortest and longest time, in seconds, from an effect's first failed delivery to its
    last (then it is ``dead``) when every delivery fails with an error that is retried: the sum
    of the waits between ``fence_outbox_max_attempts`` deliveries (about 5.7 and 11.4 hours at
    the defaults). The sender's own latency (the sweep's period, a busy worker) comes on top."""
    top = sum(retry_ceiling(n, config) for n in range(1, config.outbox_max_attempts))
    return top / 2, top
