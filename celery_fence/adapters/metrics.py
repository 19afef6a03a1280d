"""A worker's ``/metrics``: served by its main process on ``fence_metrics_port``.

At ``worker_init`` (the main process, before a prefork pool forks) metrics are turned on when
:func:`celery_fence.metrics.wanted` says so. Under prefork the children observe in
prometheus_client's multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` is used when the user set it,
else the worker makes a temporary one (removed at ``worker_shutdown``); the main process serves
their sum. Solo, threads and gevent observe in the main process's own registry, which it serves.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_init, worker_shutdown
from celery.utils.dispatch import Signal

from celery_fence import metrics
from celery_fence.app_state import AppSlot, installed
from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError
from celery_fence.settings import read_setting

logger = logging.getLogger("celery_fence")


@dataclass
class _Served:
    server: Any = None
    thread: Any = None
    #: The multiprocess directory this worker made (None: the user's, or none).
    made_dir: str | None = None


_served = _Served()


def is_prefork(pool_cls: Any) -> bool:
    """Whether a worker's ``pool_cls`` (a name or a class) is the prefork pool."""
    from celery import concurrency
    from celery.concurrency.prefork import TaskPool

    try:
        cls = concurrency.get_implementation(pool_cls)
    except Exception:
        return False
    return isinstance(cls, type) and issubclass(cls, TaskPool)


def multiprocess_dir(prefork: bool) -> str | None:
    """The multiprocess directory this worker's processes write to: the user's
    ``PROMETHEUS_MULTIPROC_DIR``, else (prefork) a temporary one made now; None: in-process."""
    given = os.environ.get(metrics.MULTIPROC_ENV)
    if given:
        return given
    if not prefork:
        return None
    made = tempfile.mkdtemp(prefix="celery-fence-metrics-")
    os.environ[metrics.MULTIPROC_ENV] = made
    _served.made_dir = made
    return made


def registry_to_serve(directory: str | None) -> Any:
    """The registry ``/metrics`` shows: the sum of the multiprocess files in ``directory``, or
    (None) prometheus_client's default registry."""
    import prometheus_client
    from prometheus_client import multiprocess

    if directory is None:
        return prometheus_client.REGISTRY
    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


def start(config: FenceConfig, *, prefork: bool) -> None:
    """Turn metrics on in this (the worker's main) process and, with ``fence_metrics_port``,
    serve them. Exits the worker with one line when the port cannot be listened on."""
    directory = multiprocess_dir(prefork)
    if directory is not None:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()  # imported before the variable was set
    metrics.enable()
    port = config.metrics_port
    if port is None:
        return
    import prometheus_client

    try:
        _served.server, _served.thread = prometheus_client.start_http_server(
            port, registry=registry_to_serve(directory)
        )
    except OSError as exc:
        message = (
            f"celery-fence: fence_metrics_port={port}: cannot serve /metrics ({exc}); choose a "
            "free port; the worker does not start"
        )
        logger.critical(message)
        raise SystemExit(message) from None
    logger.info(
        "celery-fence metrics on http://0.0.0.0:%s/metrics (%s)",
        port,
        "multiprocess" if directory else "in-process",
    )


def stop() -> None:
    """Stop serving and remove the multiprocess directory this worker made."""
    if _served.server is not None:
        _served.server.shutdown()
        _served.server.server_close()
        _served.server = _served.thread = None
    made, _served.made_dir = _served.made_dir, None
    if made is not None:
        if os.environ.get(metrics.MULTIPROC_ENV) == made:
            del os.environ[metrics.MULTIPROC_ENV]
        shutil.rmtree(made, ignore_errors=True)
    metrics.disable()


#: Whether an app's fenced messages carry their publish time, decided once per app.
_STAMPS: AppSlot[bool] = AppSlot("stamps_publish")


def stamps_publish(app: Any) -> bool:
    """Whether a fenced ``apply_async`` of ``app`` stamps its message with the publish time
    (``fence_published_at``, where the metrics' queue wait starts): when metrics are on in this
    process, or the app's ``fence_metrics`` / ``fence_metrics_port`` (or
    ``PROMETHEUS_MULTIPROC_DIR``) would turn them on in a worker. Read from ``app.conf`` once
    per app (an invalid value: stamped, the worker's settings check names it)."""
    if metrics.active is not None:
        return True
    decided = _STAMPS.get(app)
    if decided is None:
        try:
            setting = read_setting(app.conf, "metrics")
            port = read_setting(app.conf, "metrics_port")
        except ConfigurationError:
            decided = True
        else:
            decided = metrics.may_observe(setting=setting, port=port)
        _STAMPS.set(app, decided)
    return decided


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app: Any = getattr(sender, "app", None)
    if not installed(app):
        return
    try:
        config = FenceConfig.from_app(app)
    except ConfigurationError:
        # Invalid settings are the settings check's to refuse (at the worker's start) or the
        # first task's settle step's (a task that opts out of the start check): no metrics then.
        return
    try:
        if not metrics.wanted(setting=config.metrics, port=config.metrics_port):
            return
    except ConfigurationError as exc:  # metrics asked for without prometheus_client
        message = f"celery-fence: invalid settings, the worker does not start: {exc}"
        logger.critical(message)
        raise SystemExit(message) from None
    start(config, prefork=is_prefork(getattr(sender, "pool_cls", None)))


def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    app: Any = getattr(sender, "app", None)
    if app is not None and installed(app):
        stop()


#: The process-wide receivers :func:`celery_fence.install` connects.
RECEIVERS: tuple[tuple[Signal, Any], ...] = (
    (worker_init, _on_worker_init),
    (worker_shutdown, _on_worker_shutdown),
)

__all__ = [
    "RECEIVERS",
    "is_prefork",
    "multiprocess_dir",
    "registry_to_serve",
    "stamps_publish",
    "start",
    "stop",
]
