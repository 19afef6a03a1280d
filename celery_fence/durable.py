"""``enqueue()``: a fenced job written in the caller's own transaction, sent after it commits.

``task.delay()`` after a commit loses the job when the process dies (or the broker is down)
between the two; ``delay()`` inside the transaction sends a message for data a rollback then
removes. :func:`enqueue` closes both windows::

    with engine.begin() as conn:                      # your transaction (SQLAlchemy)
        conn.execute(orders.insert().values(id=order_id))
        enqueue(conn, ship_order, args=(order_id,))   # a pending job row, in this transaction

- The job's row (``pending``, never claimed, with the request it will be sent with) is written
  on ``conn``, so it commits or rolls back with your data: rolled back, no row and no message.
- The message is published **after** the commit. If the process dies first, or the publish
  fails, the row stays ``pending``: ``celery fence recover`` (and its beat task) sends it once it
  has not moved for ``fence_recover_pending_after`` seconds (60 by default; a countdown or eta
  is waited for). A broker that loses queued messages loses nothing either: the row is the
  record, and recovery re-sends it (one still in a long backlog is sent twice; the copies are
  fenced on the key, so it completes once).
- The same key twice: one job. The second call writes and sends nothing and returns the job it
  found (``created`` false, its ``status``; a completed one's result is in the store, a dead one
  waits for ``fence requeue``).

``conn`` is an SQLAlchemy ``Connection`` in a transaction (``engine.begin()``), an ORM
``Session`` (a ``scoped_session`` such as Flask-SQLAlchemy's ``db.session`` too), or ``None``:
Django's connection for the store's alias, inside ``transaction.atomic()``
(:mod:`celery_fence.contrib.django.durable`). Each must be on the store's database, which is what
makes the row part of your transaction (anything else is refused with
:class:`ConfigurationError`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session

from celery_fence.actions import LogAction
from celery_fence.adapters.task import FencedTask
from celery_fence.body import sqla
from celery_fence.body.transaction import different_database
from celery_fence.errors import ConfigurationError, FenceError
from celery_fence.ops.recovery import KEY_HEADER
from celery_fence.schema import utcnow
from celery_fence.store.records import ENQUEUED_HEADER, encode_request

logger = logging.getLogger("celery_fence.durable")


@dataclass(frozen=True)
class Enqueued:
    """What :func:`enqueue` did: ``created`` a new job (sent after the commit), or found the
    key's existing job (``status``) and sent nothing."""

    key: str
    task_id: str
    created: bool
    status: str
    task: Any = field(repr=False)

    @property
    def async_result(self) -> Any:
        """The Celery ``AsyncResult`` of the job's message (needs a result backend to wait on)."""
        return self.task.AsyncResult(self.task_id)


@dataclass(frozen=True)
class _Send:
    task: Any
    key: str
    task_id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]


def enqueue(
    conn: sa.Connection | Session | scoped_session[Any] | None,
    task: Any,
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Enqueued:
    """Write ``task(*args, **kwargs)`` as a ``pending`` job in ``conn``'s transaction and send
    it when that transaction commits. ``options`` are ``apply_async``'s (countdown, eta, queue,
    priority, headers, expires, task_id). See the module docstring."""
    if not isinstance(task, FencedTask):
        raise ConfigurationError(
            f"enqueue() takes a fenced task (@app.task(base=FencedTask, ...)), not "
            f"{getattr(task, 'name', type(task).__name__)!r}: only a fenced job has a row to "
            "write"
        )
    if isinstance(conn, scoped_session):  # Flask-SQLAlchemy's db.session: this thread's Session
        conn = conn()
    args, kwargs = tuple(args), dict(kwargs or {})
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    key = task.logical_key(args, kwargs, task_id)
    store = task.fence_backends().store
    if conn is None:  # Django's connection; Django is optional, so imported only when asked for
        from celery_fence.contrib.django.durable import django_target

        target: _Target = django_target(task, store)
    else:
        target = _SqlAlchemyTarget(conn, store)
    request = encode_request(
        task.name, args, kwargs, _context(task, args, kwargs, task_id, options)
    )
    if request is None:
        raise ConfigurationError(
            f"enqueue({task.name}): the arguments are not JSON, so the job cannot be stored to "
            "be re-sent; pass plain dicts, lists, str, int, float, bool or None"
        )
    created, status, stored = target.insert(key, task.name, request, _due(options))
    if not created:
        stored_id = (stored or {}).get("id")
        return Enqueued(
            key=key,
            task_id=str(stored_id or task_id),
            created=False,
            status=status or "unknown",
            task=task,
        )
    target.after_commit(_Send(task, key, task_id, args, kwargs, options))
    return Enqueued(key=key, task_id=task_id, created=True, status="pending", task=task)


class _Target(Protocol):
    """Where the job's row is written, and what sends its message after the commit."""

    def insert(
        self, key: str, task_name: str, request: Mapping[str, Any], due: dt.datetime | None
    ) -> tuple[bool, str | None, Mapping[str, Any] | None]:
        """``(True, None, None)``: written; ``(False, status, request)``: the key's job."""

    def after_commit(self, send: _Send) -> None:
        """Send once the transaction commits; forget it when it rolls back."""


class _SqlAlchemyTarget:
    def __init__(self, conn: Any, store: Any) -> None:
        self.conn = conn
        self.store = store
        self.connection = _connection_of(conn)
        _check_same_database(store.url, self.connection.engine.url)

    def insert(
        self, key: str, task_name: str, request: Mapping[str, Any], due: dt.datetime | None
    ) -> tuple[bool, str | None, Mapping[str, Any] | None]:
        created, existing = self.store.insert_pending(
            self.connection, key, task_name=task_name, request=request, due=due
        )
        if created or existing is None:
            return created, None, None
        return False, existing.status, existing.request

    def after_commit(self, send: _Send) -> None:
        _after_commit(self.conn, send)


def _due(options: Mapping[str, Any]) -> dt.datetime | None:
    """When the message's countdown or eta lets it run (UTC), or None: recovery does not send a
    job early."""
    if options.get("countdown") is not None:
        return utcnow() + dt.timedelta(seconds=float(options["countdown"]))
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = dt.datetime.fromisoformat(eta)
    if isinstance(eta, dt.datetime):
        return eta if eta.tzinfo is not None else eta.replace(tzinfo=dt.timezone.utc)
    return None


def _connection_of(conn: Any) -> sa.Connection:
    if isinstance(conn, (Session, sa.Connection)) and conn.in_nested_transaction():
        raise ConfigurationError(
            "enqueue() inside a savepoint (begin_nested()): enqueue in the outer transaction, "
            "whose commit sends the message (a rolled-back savepoint would leave a message "
            "without its row)"
        )
    if isinstance(conn, Session):
        return conn.connection()
    if isinstance(conn, sa.Connection):
        if not conn.in_transaction():
            raise ConfigurationError(
                "enqueue(conn, ...) needs a connection in a transaction (with engine.begin() as "
                "conn:): the job's row must commit or roll back with your data"
            )
        return conn
    raise ConfigurationError(
        f"enqueue() takes an SQLAlchemy Connection or Session, not {type(conn).__name__}"
    )


def _check_same_database(store_url: str, theirs: sa.URL) -> None:
    ours = sa.engine.make_url(store_url)
    reason = different_database(ours, theirs)
    if reason is not None:
        raise ConfigurationError(
            f"enqueue(conn, ...): the connection is on {theirs.render_as_string()}, not on the "
            f"fence store's database {ours.render_as_string()} ({reason}); the job's row must be "
            "written in your transaction: set fence_database_url to your app's database"
        )


def _context(
    task: Any, args: Any, kwargs: Any, task_id: str, options: Mapping[str, Any]
) -> SimpleNamespace:
    """What the stored request is made of, shaped like the worker's request of the message about
    to be sent: its id, the exchange and routing key it will be delivered with, and its workflow
    and limits (``link``, ``link_error``, time limits, headers), so recovery re-sends it whole."""
    route = task.app.amqp.router.route(dict(options), task.name, args, kwargs)
    queue = route.get("queue")
    exchange = route.get("exchange") or getattr(getattr(queue, "exchange", None), "name", None)
    routing_key = route.get("routing_key") or getattr(queue, "routing_key", None)
    return SimpleNamespace(
        id=task_id,
        delivery_info={
            "exchange": exchange,
            "routing_key": routing_key,
            "priority": options.get("priority"),
        },
        callbacks=_signatures(options.get("link")),
        errbacks=_signatures(options.get("link_error")),
        timelimit=(options.get("time_limit"), options.get("soft_time_limit")),
        headers=options.get("headers"),
        shadow=options.get("shadow"),
    )


def _signatures(value: Any) -> list[Any] | None:
    if not value:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


# -- after the commit -----------------------------------------------------------------------------

#: Sends waiting for the commit of each Connection or Session. Keyed by the object itself, never
#: by the pooled DBAPI connection's ``info``: a connection returned to the pool without a commit
#: must not carry its sends to the next user. (enqueue refuses a savepoint, so every row belongs
#: to the outermost transaction and goes with its commit or rollback.)
_WAITING: weakref.WeakKeyDictionary[Any, list[_Send]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _after_commit(conn: Any, send: _Send) -> None:
    """Send once ``conn``'s transaction commits; forget it when it rolls back."""
    with _LOCK:
        pending = _WAITING.get(conn)
        if pending is None:
            pending = _WAITING[conn] = []
            if not _listening(conn):
                events = _SESSION_EVENTS if isinstance(conn, Session) else _CONNECTION_EVENTS
                for name, fn in events.items():
                    sa.event.listen(conn, name, fn)
        pending.append(send)


def _listening(target: Any) -> bool:
    events = _SESSION_EVENTS if isinstance(target, Session) else _CONNECTION_EVENTS
    name, fn = next(iter(events.items()))
    return sa.event.contains(target, name, fn)


def _drain(target: Any) -> list[_Send]:
    with _LOCK:
        return _WAITING.pop(target, None) or []


def publish(sends: list[_Send]) -> None:
    """Send each job now (its transaction has committed); a failed send leaves the row
    ``pending`` for recovery."""
    _publish(sends)


def _publish(sends: list[_Send]) -> None:
    for send in sends:
        headers = {
            **dict(send.options.get("headers") or {}),
            KEY_HEADER: send.key,
            ENQUEUED_HEADER: 1,  # a first delivery: its deferred claim may complete the row
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


# SQLAlchemy Core: a Connection has no after-commit event. Its commit listener runs just
# before the driver's commit: it commits the driver's transaction itself, then sends, and
# SQLAlchemy's own commit that follows finds nothing to commit. A listener registered earlier
# (a fenced block's ownership check) has run by then.


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


# The ORM: the Session's own after-commit event.


def _session_committed(session: Session) -> None:
    _publish(_drain(session))


def _session_rolled_back(session: Session) -> None:
    _drain(session)


_SESSION_EVENTS: dict[str, Callable[..., None]] = {
    "after_commit": _session_committed,
    "after_rollback": _session_rolled_back,
}


__all__ = ["Enqueued", "enqueue"]
