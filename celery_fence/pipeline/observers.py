"""What one attempt's :class:`~celery_fence.leases.lease.HeldLease` calls when it is renewed or
lost: announce it, and record a loss in the store. The lease layer only calls them; they live
with the attempt that hands them to its lease."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from celery_fence.actions import Action
from celery_fence.announce.transitions import Announcer
from celery_fence.leases.lease import HeldLease
from celery_fence.leases.renewer import RENEWER_THREAD_NAME
from celery_fence.pipeline.ports import JobStore
from celery_fence.process.background import BackgroundWriter
from celery_fence.process.runtime import runtime

logger = logging.getLogger("celery_fence")


def lease_observers(
    announcer: Announcer, store: JobStore
) -> tuple[Callable[[HeldLease, str], None], Callable[[HeldLease], None]]:
    """``(on_lost, on_renewed)`` of one attempt's :class:`HeldLease`: announce, and record a
    loss in ``store``."""
    return (
        functools.partial(_on_lost, announcer, store),
        functools.partial(_on_renewed, announcer),
    )


def _on_lost(announcer: Announcer, store: JobStore, lease: HeldLease, reason: str) -> None:
    announcer(
        Action.LOST,
        key=lease.key,
        attempt_id=lease.token,
        generation=lease.generation,
        reason=reason,
    )
    if threading.current_thread().name != RENEWER_THREAD_NAME:
        _record_lost(store, lease, reason)  # the task noticed: record before it goes on
        return
    # The renewal thread noticed: write the history row off that thread, so a slow database
    # never delays the renewal of the process's other leases.
    runtime().get("writer", None, BackgroundWriter).submit(_record_lost, store, lease, reason)


def _record_lost(store: JobStore, lease: HeldLease, reason: str) -> None:
    try:
        store.record(
            lease.key,
            action=Action.LOST,
            generation=lease.generation,
            attempt_id=lease.token,
            reason=reason,
        )
    except Exception as exc:  # the loss is already in force locally; the record is history
        logger.warning(
            "could not record lease loss key=%s generation=%s: %s",
            lease.key,
            lease.generation,
            type(exc).__name__,
        )


def _on_renewed(announcer: Announcer, lease: HeldLease) -> None:
    announcer(Action.RENEWED, key=lease.key, attempt_id=lease.token, generation=lease.generation)


__all__ = ["lease_observers"]
