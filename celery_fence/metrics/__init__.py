"""Prometheus metrics: counters and histograms a worker observes, gauges read from the store.

Off unless asked for (``fence_metrics``, ``fence_metrics_port``, or
``PROMETHEUS_MULTIPROC_DIR`` set): then :data:`active` stays None and every hook in the hot path
is one ``is None`` test. Importing this package never imports ``prometheus_client``;
:func:`enable` does (and refuses with :class:`~celery_fence.errors.ConfigurationError` naming
``pip install 'celery-fence[prometheus]'`` when it is missing).

- :mod:`celery_fence.metrics.families`: the metric families and :class:`Metrics`, the one
  observer (:func:`celery_fence.announce.transitions.emit_transition` calls it for every
  transition; the claim, the renewer, the fenced commits and the outbox call it for what
  transitions do not carry);
- :mod:`celery_fence.adapters.metrics`: the worker's ``/metrics`` endpoint (multiprocess mode
  under prefork);
- :mod:`celery_fence.ops.metrics`: the store gauges, served by ``celery -A proj fence metrics``.

Labels name the task (or the outbox effect), a ``where`` or a ``reason`` class: never a key,
arguments, results or payloads.
"""

from __future__ import annotations

import os
from typing import Any

from celery_fence.errors import ConfigurationError
from celery_fence.metrics import families
from celery_fence.metrics.families import INSTALL_HINT, Metrics

#: The observer of this process: None while metrics are off (the hooks then do nothing).
active: Metrics | None = None

#: The environment variable of prometheus_client's multiprocess mode.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def available() -> bool:
    """Whether ``prometheus_client`` can be imported."""
    return families.Counter is not None


def wanted(*, setting: bool | None, port: int | None) -> bool:
    """Whether the settings turn metrics on: ``fence_metrics`` (``setting``) when set; else on
    when ``prometheus_client`` is importable and ``fence_metrics_port`` (``port``) or
    ``PROMETHEUS_MULTIPROC_DIR`` is set. Raises :class:`ConfigurationError` when metrics are asked
    for explicitly (``fence_metrics=True`` or a port) and ``prometheus_client`` is missing."""
    if setting is not False and (setting is True or port is not None) and not available():
        named = "fence_metrics=True" if setting else "fence_metrics_port"
        raise ConfigurationError(
            f"{named} needs prometheus_client, which is not installed: {INSTALL_HINT} "
            "(or unset it)."
        )
    return may_observe(setting=setting, port=port)


def may_observe(*, setting: bool | None, port: int | None) -> bool:
    """:func:`wanted` without its refusal: whether a worker given these settings observes. A
    sender reads it to decide whether its messages carry their publish time (the queue wait's
    start), where ``prometheus_client`` need not be installed."""
    if setting is False:
        return False
    asked = setting is True or port is not None
    return asked or (bool(os.environ.get(MULTIPROC_ENV)) and available())


def enable() -> Metrics:
    """Turn the observer of this process on (idempotent): the metric families are registered
    with prometheus_client's default registry once. Raises :class:`ConfigurationError` when
    ``prometheus_client`` is missing."""
    global active
    if active is None:
        active = Metrics.shared()  # ConfigurationError without prometheus_client
    return active


def disable() -> None:
    """Turn the observer off (the families stay registered; nothing is observed any more)."""
    global active
    active = None


def observe_transition(action: Any, sender: Any, reason: str | None, extra: Any) -> None:
    """:func:`~celery_fence.announce.transitions.emit_transition`'s hook."""
    m = active
    if m is not None:
        m.transition(action, sender, reason, extra)


__all__ = [
    "INSTALL_HINT",
    "MULTIPROC_ENV",
    "Metrics",
    "active",
    "available",
    "disable",
    "enable",
    "may_observe",
    "observe_transition",
    "wanted",
]
