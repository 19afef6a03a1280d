"""What the admin's actions do, through the same store and recovery functions as
``celery fence requeue`` and ``celery fence recover``."""

from __future__ import annotations

from typing import Any

from ... import recovery
from ...actions import Action
from ...config import FenceConfig
from ...errors import StaleGeneration
from ...schema import DEAD
from ...store import store_for
from ...transitions import emit_transition


def current_celery_app() -> Any:
    """The project's Celery app (``proj/celery.py``'s, the current one once Django loaded it)."""
    from celery import current_app

    return current_app._get_current_object()


def requeue_dead(app: Any, key: str) -> str:
    """Re-send a dead job (same key, fresh attempt budget), as ``celery fence requeue KEY``;
    returns what happened, in words. A job that is not dead is left alone."""
    store = store_for(FenceConfig.from_app(app))
    record = store.get(key)
    if record is None:
        return f"{key}: no such job"
    if record.status != DEAD:
        return f"{key}: {record.status}, not dead; left alone"
    if not record.request:
        return f"{key}: no stored request (its arguments were not JSON); re-send it from your code"
    before = store.requeue(key)  # durable first: pending, with a fresh budget
    try:
        task_id = recovery.send_stored(app, before)
    except Exception as exc:
        try:
            store.restore_finished(before, reason=f"send failed ({type(exc).__name__})")
        except StaleGeneration:
            return f"{key}: the send failed ({type(exc).__name__}) and an attempt claimed it since"
        return f"{key}: the send failed ({type(exc).__name__}); it is dead again"
    task_name = str((before.request or {}).get("task") or before.task_name)
    emit_transition(
        Action.REQUEUED,
        app.tasks.get(task_name, task_name),
        key=key,
        attempt_id=None,
        generation=before.generation,
        reason="requeued by operator (admin)",
        countdown=0.0,
        attempts=0,
    )
    return f"{key}: requeued as {task_id}"


def recover_stranded(app: Any) -> str:
    """One ``celery fence recover`` run; returns its summary."""
    report = recovery.recover(app)
    summary = f"{len(report.stranded)} stranded job(s), {len(report.sent)} re-sent"
    if report.dead:
        summary += f", {len(report.dead)} without a stored request now dead"
    if report.failed:
        summary += f", {len(report.failed)} could not be sent: {', '.join(report.failed[:5])}"
    return summary
