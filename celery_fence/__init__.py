"""celery-fence: fenced, retry-safe Celery tasks.

A Redis lease with an owner token and an ever-increasing generation decides who works; a SQL
store fenced on that generation decides whose result counts.
"""

from .backends import get_store
from .config import FenceConfig
from .durable import Enqueued, enqueue
from .errors import (
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
from .fence import Fence
from .outbox import Outbox, idempotency_key, register_handler, storage_key
from .recovery import recover
from .retention import purge_expired
from .schema import metadata
from .store import JobRecord, Store
from .task import FencedTask

try:  # one version, in setup.cfg: the installed distribution's metadata
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    __version__ = _version("celery-fence")
except PackageNotFoundError:  # pragma: no cover - run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
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
    "metadata",
    "purge_expired",
    "recover",
    "register_handler",
    "storage_key",
]
