"""An operator's requeue of a finished job: the one path of ``celery fence requeue KEY`` (and
``--completed``) and of the Django admin's requeue action.

Durable first: the row goes ``pending`` with a fresh attempt budget (a compare-and-set on the
job as read), then its stored request is re-sent under its key (:func:`recovery.send_stored`).
A send that fails puts the row back as it was (``dead``, or ``completed``), so nothing waits for
a message that was never sent; if an attempt claimed the job meanwhile, it is left to that
attempt. Each caller words the outcome its own way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_fence.actions import Action
from celery_fence.announce.transitions import emit_transition
from celery_fence.errors import FenceError, StaleGeneration
from celery_fence.ops.recovery import NotResendable, send_stored
from celery_fence.store import JobRecord, Store


@dataclass(frozen=True)
class Requeued:
    """A requeue that was sent: the job as it was before (its stored request, its routing) and
    the Celery task id of the new message."""

    record: JobRecord
    task_id: str


class SendFailed(FenceError):
    """The requeue's message could not be sent. ``restored``: the job is back as it was;
    otherwise an attempt claimed it meanwhile and it was left as it is."""

    def __init__(self, record: JobRecord, cause: BaseException, *, restored: bool) -> None:
        super().__init__(f"could not send {record.key!r} ({type(cause).__name__})")
        self.record = record
        self.cause = cause
        self.restored = restored


def requeue_finished(
    app: Any,
    store: Store,
    key: str,
    *,
    completed: bool = False,
    reason: str,
    stored_reason: str | None = None,
) -> Requeued:
    """Requeue the dead job ``key`` (``completed``: the completed one) of ``store`` and send it.

    Raises :class:`~celery_fence.ops.recovery.NotResendable` when the job has no stored request,
    :class:`~celery_fence.errors.StoreError` when it is not dead (not completed), and
    :class:`SendFailed` when the send failed. ``reason`` is the ``requeued`` transition's, as
    signalled and logged; the transitions table gets ``stored_reason`` (default: the store's
    own, ``by operator``).
    """
    record = store.get(key)
    if record is not None and not record.request:
        raise NotResendable(
            f"job {key!r} has no stored request (its arguments or workflow were not JSON): "
            "re-send it from your code"
        )
    before = store.admin.requeue(
        key, completed=completed, reason=stored_reason
    )  # durable first: pending, fresh budget
    try:
        task_id = send_stored(app, before)
    except Exception as exc:
        try:
            store.admin.restore_finished(before, reason=f"send failed ({type(exc).__name__})")
        except StaleGeneration:
            raise SendFailed(before, exc, restored=False) from None
        raise SendFailed(before, exc, restored=True) from None
    task_name = str((before.request or {}).get("task") or before.task_name)
    emit_transition(
        Action.REQUEUED,
        app.tasks.get(task_name, task_name),
        key=key,
        attempt_id=None,
        generation=before.generation,
        reason=reason,
        countdown=0.0,
        attempts=0,
    )
    return Requeued(before, task_id)


__all__ = ["Requeued", "SendFailed", "requeue_finished"]
