"""What the admin's actions do, through the same functions as ``celery fence requeue``
(:func:`celery_fence.ops.requeue.requeue_finished`) and ``celery fence recover``."""

from __future__ import annotations

from typing import Any

from celery_fence.config import FenceConfig
from celery_fence.ops import recovery
from celery_fence.ops.requeue import SendFailed, requeue_finished
from celery_fence.pipeline.backends import store_for
from celery_fence.schema import DEAD


def current_celery_app() -> Any:
    """The project's Celery app (``proj/celery.py``'s, the current one once Django loaded it)."""
    from celery import current_app

    return current_app._get_current_object()


def requeue_dead(app: Any, key: str, *, by: str | None = None) -> str:
    """Re-send a dead job (same key, fresh attempt budget), as ``celery fence requeue KEY``;
    returns what happened, in words (beginning with ``job``, never with the key: Django's admin
    capitalises a message's first letter). A job that is not dead is left alone. ``by`` (the admin
    user's name) is recorded in the transition's reason: ``requeued by admin user alice``."""
    store = store_for(FenceConfig.from_app(app))
    record = store.get(key)
    if record is None:
        return f"job {key}: no such job"
    if record.status != DEAD:
        return f"job {key}: {record.status}, not dead; left alone"
    try:
        reason = f"requeued by admin user {by}" if by else "requeued by operator (admin)"
        done = requeue_finished(app, store, key, reason=reason, stored_reason=reason)
    except recovery.NotResendable:
        return (
            f"job {key}: no stored request (its arguments were not JSON); re-send it from your code"
        )
    except SendFailed as failed:
        name = type(failed.cause).__name__
        if not failed.restored:
            return f"job {key}: the send failed ({name}) and an attempt claimed it since"
        return f"job {key}: the send failed ({name}); it is dead again"
    return f"job {key}: requeued as {done.task_id}"


def recover_stranded(app: Any) -> str:
    """One ``celery fence recover`` run; returns its summary."""
    report = recovery.recover(app)
    summary = f"{len(report.stranded)} stranded job(s), {len(report.sent)} re-sent"
    if report.dead:
        summary += f", {len(report.dead)} without a stored request now dead"
    if report.failed:
        summary += f", {len(report.failed)} could not be sent: {', '.join(report.failed[:5])}"
    return summary
