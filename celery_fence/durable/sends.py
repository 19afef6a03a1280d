"""What :func:`celery_fence.enqueue` sends once the caller's transaction commits: each job's
message (:class:`Send`), waiting on its connection's outermost commit (:func:`after_commit`),
forgotten at its rollback, published right after the commit (:func:`publish`). A send that
fails leaves the row ``pending`` for recovery (``celery fence recover``)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from celery_fence.actions import LogAction
from celery_fence.body import sqla
from celery_fence.errors import FenceError
from celery_fence.ops.recovery import KEY_HEADER
from celery_fence.store.records import ENQUEUED_HEADER

logger = logging.getLogger("celery_fence.durable")


@dataclass(frozen=True)
class Send:
    """One job's message, sent after its row commits."""

    task: Any
    key: str
    task_id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]


#: Sends waiting for the commit of each Connection (a Session's too: its connection on the
#: store's database). Keyed by the object itself, never by the pooled DBAPI connection's
#: ``info``: a connection returned to the pool without a commit must not carry its sends to the
#: next user. (enqueue refuses a savepoint, so every row belongs to the outermost transaction and
#: goes with its commit or rollback.)
_WAITING: weakref.WeakKeyDictionary[Any, list[Send]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def after_commit(conn: sa.Connection, send: Send) -> None:
    """Send once ``conn``'s outermost transaction commits; forget it when it rolls back."""
    with _LOCK:
        pending = _WAITING.get(conn)
        if pending is None:
            pending = _WAITING[conn] = []
            if not _listening(conn):
                for name, fn in _CONNECTION_EVENTS.items():
                    sa.event.listen(conn, name, fn)
        pending.append(send)


def _listening(target: sa.Connection) -> bool:
    name, fn = next(iter(_CONNECTION_EVENTS.items()))
    return sa.event.contains(target, name, fn)


def _drain(target: Any) -> list[Send]:
    with _LOCK:
        return _WAITING.pop(target, None) or []


def publish(sends: list[Send]) -> None:
    """Send each job now (its transaction has committed); a failed send leaves the row
    ``pending`` for recovery."""
    _publish(sends)


def _publish(sends: list[Send]) -> None:
    for send in sends:
        headers = {
            **dict(send.options.get("headers") or {}),
            KEY_HEADER: send.key,
            ENQUEUED_HEADER: 1,  # enqueue()'s own send: a re-send or recovery drops it
        }
        options = {k: v for k, v in send.options.items() if k != "headers"}
        try:
            send.task.apply_async(
                send.args, send.kwargs, task_id=send.task_id, headers=headers, **options
            )
        except Exception as exc:  # committed: the row is the record, recovery sends it
            logger.warning(
                "fence enqueue could not send key=%s task=%s (%s); it stays pending and "
                "'celery fence recover' sends it",
                send.key,
                send.task_id,
                type(exc).__name__,
                extra={"action": LogAction.ENQUEUE_UNSENT, "fence_key": send.key},
            )


# A Connection has no after-commit event. Its commit event fires only for its outermost
# transaction (not a savepoint's release, not a joined Session's commit), just before the
# driver's commit: the listener commits the driver's transaction itself, then sends, and
# SQLAlchemy's own commit that follows finds nothing to commit. A listener registered earlier
# (a fenced block's ownership check) has run by then. An ORM Session commits through the same
# event of its connection.


def _conn_commit(conn: sa.Connection) -> None:
    sends = _drain(conn)
    if not sends:
        return
    dbapi = conn.connection.dbapi_connection
    if dbapi is None:  # pragma: no cover - a closed connection cannot commit
        raise FenceError("enqueue: the connection closed before its commit")
    # This listener runs before the engine-wide ones: the fence's check of the transaction's
    # writes (refused beside an open block, flagged outside one) runs here, before the commit.
    sqla.before_commit(conn)
    dbapi.commit()  # raises if the commit fails: nothing is sent, the caller sees the error
    _publish(sends)


def _conn_rollback(conn: sa.Connection) -> None:
    _drain(conn)


_CONNECTION_EVENTS: dict[str, Callable[..., None]] = {
    "commit": _conn_commit,
    "rollback": _conn_rollback,
}


__all__ = ["Send", "after_commit", "publish"]
