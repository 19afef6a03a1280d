"""The fenced result store: the one place that runs SQL on celery-fence's tables (their DDL is
:mod:`celery_fence.schema`'s and the migrations'; :mod:`celery_fence.transaction` sends the block
statements of :mod:`.sql` on the user's own connection).

- :mod:`.sql`: every statement, per dialect;
- :mod:`.engine`: the engine, its bounds on every wait, the raw path and driver-error redaction;
- :mod:`.fenced`: the one fenced write (statement + transition rows + outbox rows, atomically);
- :mod:`.jobs`: :class:`Store`, the verbs of a task's path and the reads;
- :mod:`.admin`: the operator's and the recovery's verbs (methods of :class:`Store` too);
- :mod:`.outbox`: the outbox's rows, composed as ``store.outbox``.

Its values (records, requests, effects) live in :mod:`celery_fence.records`.
"""

from __future__ import annotations

import threading
from typing import Any

from ..records import (
    Effect,
    JobRecord,
    Registration,
    Transition,
    decode_request,
    dumps_strict,
    encode_request,
)
from ..schema import COMPLETED, DEAD, PENDING, RETRYING, RUNNING, utcnow
from .admin import UNFINISHED
from .jobs import Store
from .outbox import OutboxRow, OutboxStore

_stores: dict[tuple[Any, ...], Store] = {}
_stores_lock = threading.Lock()


def store_for(config: Any) -> Store:
    """The process-wide store for a :class:`~celery_fence.config.FenceConfig`."""
    ident = (
        config.database_url,
        config.record_transitions,
        config.unfenced,
        config.defer_first_registration,
        config.error_message_length,
        config.database_timeout,
        config.lock_timeout,
    )
    with _stores_lock:
        store = _stores.get(ident)
        if store is None:
            store = _stores[ident] = Store(
                config.database_url,
                record_transitions=config.record_transitions,
                unfenced=config.unfenced,
                defer_first_registration=config.defer_first_registration,
                error_message_length=config.error_message_length,
                database_timeout=config.database_timeout,
                lock_timeout=config.lock_timeout,
            )
        return store


__all__ = [
    "COMPLETED",
    "DEAD",
    "PENDING",
    "RETRYING",
    "RUNNING",
    "UNFINISHED",
    "Effect",
    "JobRecord",
    "OutboxRow",
    "OutboxStore",
    "Registration",
    "Store",
    "Transition",
    "decode_request",
    "dumps_strict",
    "encode_request",
    "store_for",
    "utcnow",
]
