"""celery-fence: fenced, retry-safe Celery tasks.

A Redis lease with an owner token and an ever-increasing generation decides who works; a SQL
store fenced on that generation decides whose result counts.

Importing ``celery_fence`` connects no Celery signal receiver and registers no task on any app;
:func:`install` adds celery-fence to one app, and :class:`FencedTask` calls it for its app. What
each does is described once, in docs/design.md, "What importing does, and what install(app)
does".
"""

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from celery_fence import django_port, durable
from celery_fence.adapters.installation import install
from celery_fence.adapters.task import FencedTask
from celery_fence.body.fence import Fence
from celery_fence.config import FenceConfig
from celery_fence.durable import Enqueued
from celery_fence.errors import (
    AlreadyEnqueued,
    BlockIdleTimeout,
    CheckpointTooLarge,
    ConfigurationError,
    FenceError,
    JobDead,
    LeaseBusy,
    LeaseError,
    LeaseLost,
    PermanentError,
    ResultNotSerializable,
    StaleGeneration,
    StoreError,
)
from celery_fence.ops.outbox import Outbox, idempotency_key, register_handler, storage_key
from celery_fence.ops.recovery import recover
from celery_fence.ops.retention import purge_expired
from celery_fence.pipeline.backends import get_store
from celery_fence.schema import metadata
from celery_fence.store import JobRecord, Store

try:  # one version, in setup.cfg: the installed distribution's metadata
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    __version__ = _version("celery-fence")
except PackageNotFoundError:  # pragma: no cover - run from a source tree that is not installed
    __version__ = "0+unknown"


def _load_django() -> object:
    """Import the Django integration, which registers itself with :mod:`celery_fence.django_port`:
    what the core calls the first time it needs Django (Django configured, ``fence.atomic()``,
    ``fence_database``), whether or not the app is in ``INSTALLED_APPS``. The edge points down
    (this package is above ``contrib``), and Python runs this ``__init__`` before any module of
    the core: the loader is always there."""
    from celery_fence.contrib import django  # Django is optional: imported when needed

    return django


django_port.register_loader(_load_django)


def enqueue(
    conn: Any,
    task: Any,
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Enqueued:
    """``enqueue(conn, task, args=..., **options)``: write ``task(*args, **kwargs)`` as a
    ``pending`` job in ``conn``'s transaction (an SQLAlchemy ``Connection`` or ``Session``) and
    send it when that transaction commits: :func:`celery_fence.durable.enqueue`.

    ``conn=None`` (Django's connection) is deprecated: call
    :func:`celery_fence.contrib.django.enqueue` ``(task, args=..., **options)``, which it runs."""
    if conn is None:
        warnings.warn(
            "enqueue(None, task, ...) is deprecated: call "
            "celery_fence.contrib.django.enqueue(task, ...) (the same write on Django's "
            "connection)",
            DeprecationWarning,
            stacklevel=2,
        )
        from celery_fence.contrib.django import enqueue as django_enqueue  # Django is optional

        return django_enqueue(task, args, kwargs, **options)
    return durable.enqueue(conn, task, args, kwargs, **options)


__all__ = [
    "AlreadyEnqueued",
    "BlockIdleTimeout",
    "CheckpointTooLarge",
    "ConfigurationError",
    "Enqueued",
    "Fence",
    "FenceConfig",
    "FenceError",
    "FencedTask",
    "JobDead",
    "JobRecord",
    "LeaseBusy",
    "LeaseError",
    "LeaseLost",
    "Outbox",
    "PermanentError",
    "ResultNotSerializable",
    "StaleGeneration",
    "Store",
    "StoreError",
    "enqueue",
    "get_store",
    "idempotency_key",
    "install",
    "metadata",
    "purge_expired",
    "recover",
    "register_handler",
    "storage_key",
]
