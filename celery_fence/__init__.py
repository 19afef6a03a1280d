"""celery-fence: fenced, retry-safe Celery tasks.

A Redis lease with an owner token and an ever-increasing generation decides who works; a SQL
store fenced on that generation decides whose result counts.

Importing ``celery_fence`` connects no Celery signal receiver and registers no task on any app;
:func:`install` adds celery-fence to one app, and :class:`FencedTask` calls it for its app. What
each does is described once, in docs/design.md, "What importing does, and what install(app)
does".
"""

from celery_fence.adapters.installation import install
from celery_fence.adapters.task import FencedTask
from celery_fence.body.fence import Fence
from celery_fence.config import FenceConfig
from celery_fence.durable import Enqueued, enqueue
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
