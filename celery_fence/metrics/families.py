"""The metric families of celery-fence and :class:`Metrics`, the one object that observes them.

Every name starts ``celery_fence_``; counters end ``_total``. The ``task`` label is the Celery
task name; ``where`` and ``reason`` are small fixed vocabularies (:func:`retry_reason`); the
outbox's families are labelled by ``effect`` (the effect's name). Never a key, arguments,
results or payloads.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from celery_fence.actions import Action
from celery_fence.errors import ConfigurationError

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
except ImportError:  # the extra is not installed: Metrics() says which one
    REGISTRY = CollectorRegistry = Counter = Histogram = None  # type: ignore[assignment,misc]

#: What the error says when ``prometheus_client`` is missing.
INSTALL_HINT = "pip install 'celery-fence[prometheus]'"

PREFIX = "celery_fence_"

#: Queue wait and time-to-takeover reach minutes; renewals and commits are milliseconds.
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
ATTEMPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
ROUND_TRIP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
TAKEOVER_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)

#: The ``where`` of a stale refusal: a completion, a ``fence.transaction()``/``session()`` block,
#: a Django ``fence.atomic()`` block, or a registration a newer generation got to first.
STALE_WHERE = ("completion", "block", "atomic", "registration")

#: The ``reason`` classes of a scheduled retry (:func:`retry_reason`).
RETRY_REASONS = ("error", "lease_lost", "newer_generation", "unavailable", "other")

#: Counters fed by one transition each: action -> (name, help).
TRANSITION_COUNTERS: Mapping[Action, tuple[str, str]] = {
    Action.CLAIMED: ("claims", "Generations claimed (each attempt that got a lease)."),
    Action.COMPLETED: ("completions", "Fenced completions written (one per job)."),
    Action.REPLAYED: ("replays", "Deliveries answered with the stored result."),
    Action.LOST: ("lease_losses", "Leases lost by a running attempt."),
    Action.BUSY: ("busy_resends", "Messages re-sent because another attempt held the lease."),
    Action.DEAD: ("dead_jobs", "Jobs that ended dead."),
    Action.RECOVERED: ("recoveries", "Stranded jobs re-sent by recovery."),
    Action.UNFENCED_WRITE: ("unfenced_writes", "Attempts flagged for a write outside a block."),
}


def retry_reason(reason: str | None) -> str:
    """The class of a scheduled retry's reason (a label value from :data:`RETRY_REASONS`)."""
    text = (reason or "").lower()
    if text.startswith("lease lost"):
        return "lease_lost"
    if text.startswith("newer generation"):
        return "newer_generation"
    if "unavailable" in text or "not recorded" in text:
        return "unavailable"
    if text.startswith("error") or "retry in" in text:
        return "error"
    return "other"


def task_name(sender: Any) -> str:
    """The ``task`` label of a transition's sender (a task, or a task name from the CLI)."""
    if isinstance(sender, str):
        return sender
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else "unknown"


class Metrics:
    """The families, registered once per registry; every observation is a method."""

    _shared: Metrics | None = None
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        if Counter is None:
            raise ConfigurationError(f"celery-fence metrics need prometheus_client: {INSTALL_HINT}")

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, ("task", *labels), registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)

        self.by_action = {a: counter(n, d) for a, (n, d) in TRANSITION_COUNTERS.items()}
        self.stale_refusals = counter(
            "stale_refusals", "Writes refused because a newer generation owns the job.", "where"
        )
        self.takeovers = counter(
            "takeovers", "Claims that took over a job a previous attempt left running."
        )
        self.retries = counter("retries", "Retries scheduled, by reason class.", "reason")
        outbox = "effect"
        self.outbox_deliveries = Counter(
            PREFIX + "outbox_deliveries", "Outbox effects delivered.", (outbox,), registry=registry
        )
        self.outbox_failures = Counter(
            PREFIX + "outbox_failures",
            "Outbox deliveries that failed (retried later).",
            (outbox,),
            registry=registry,
        )
        self.outbox_dead = Counter(
            PREFIX + "outbox_dead_effects",
            "Outbox effects that went dead.",
            (outbox,),
            registry=registry,
        )
        self.queue_wait = histogram(
            "queue_wait_seconds",
            "Seconds from a message's publish (or its ETA) to its claim.",
            QUEUE_BUCKETS,
            "task",
        )
        self.attempt_duration = histogram(
            "attempt_duration_seconds",
            "Seconds from an attempt's claim to its settled end.",
            ATTEMPT_BUCKETS,
            "task",
        )
        self.renewal = histogram(
            "lease_renewal_seconds",
            "Seconds of one lease renewal round trip to Redis (all leases of a process).",
            ROUND_TRIP_BUCKETS,
        )
        self.commit = histogram(
            "commit_seconds",
            "Seconds of a fenced commit: a block's check and COMMIT, or a completion.",
            ROUND_TRIP_BUCKETS,
            "task",
            "where",
        )
        self.takeover = histogram(
            "takeover_seconds",
            "Seconds from the previous attempt's last recorded movement (its registration) to "
            "the claim that took the job over.",
            TAKEOVER_BUCKETS,
            "task",
        )

    @classmethod
    def shared(cls) -> Metrics:
        """The families on prometheus_client's default registry, created once per process."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    # -- observations ------------------------------------------------------------------------

    def transition(
        self, action: Action, sender: Any, reason: str | None, extra: Mapping[str, Any]
    ) -> None:
        counter = self.by_action.get(action)
        if counter is not None:
            counter.labels(task_name(sender)).inc()
        elif action is Action.STALE:
            where = extra.get("where")
            where = where if where in STALE_WHERE else "completion"
            self.stale_refusals.labels(task_name(sender), where).inc()
        elif action is Action.RETRY_SCHEDULED:
            self.retries.labels(task_name(sender), retry_reason(reason)).inc()

    def took_over(self, task: str, seconds: float | None) -> None:
        self.takeovers.labels(task).inc()
        if seconds is not None:
            self.takeover.labels(task).observe(max(0.0, seconds))

    def waited(self, task: str, seconds: float) -> None:
        self.queue_wait.labels(task).observe(max(0.0, seconds))

    def attempt(self, task: str, seconds: float) -> None:
        self.attempt_duration.labels(task).observe(seconds)

    def renewed(self, seconds: float) -> None:
        self.renewal.observe(seconds)

    def committed(self, task: str, where: str, seconds: float) -> None:
        self.commit.labels(task, where).observe(seconds)

    def outbox(self, effect: str, outcome: str) -> None:
        """``outcome``: ``delivered``, ``failed`` or ``dead``."""
        family = {
            "delivered": self.outbox_deliveries,
            "failed": self.outbox_failures,
            "dead": self.outbox_dead,
        }[outcome]
        family.labels(effect.split(":", 1)[0]).inc()


__all__ = [
    "INSTALL_HINT",
    "PREFIX",
    "RETRY_REASONS",
    "STALE_WHERE",
    "TRANSITION_COUNTERS",
    "Metrics",
    "retry_reason",
    "task_name",
]
