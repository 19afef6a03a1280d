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

``conn`` is an SQLAlchemy ``Connection`` in a transaction (``engine.begin()``) or an ORM
``Session`` (a ``scoped_session`` such as Flask-SQLAlchemy's ``db.session`` too); Django's
connection is :func:`celery_fence.contrib.django.enqueue`'s (it writes through
:func:`enqueue_on`). Each must be on the store's database, which is what
makes the row part of your transaction (anything else is refused with
:class:`ConfigurationError`), in a real transaction: a connection in ``AUTOCOMMIT`` (an engine
created with ``isolation_level="AUTOCOMMIT"``, the store's own engine) commits the row on its own
and is refused, and so is a savepoint (``begin_nested()``, or a ``Session`` that joined its
connection's transaction with a savepoint).

The message goes with the **outermost** commit of the database connection, never with a
``Session.commit()`` that does not end it: a ``Session`` joined to an outer ``Connection``
transaction (``Session(bind=conn)`` inside ``with conn.begin():``) sends when that outer
transaction commits, and nothing when it rolls back.

The options that shape the message are stored with the job, so a re-send by ``fence recover`` or
``fence requeue`` publishes it as the first send did: routing (``queue``, ``exchange``,
``routing_key``, ``priority``), workflow (``link``, ``link_error``, ``headers``, ``shadow``,
time limits), :data:`PUBLISH_OPTIONS` (``serializer``, ``compression``, ``retry``,
``retry_policy``, ``delivery_mode``, ``ignore_result``) and the due time (``countdown`` or
``eta``, stored as a UTC instant and re-sent as the ``eta``). ``expires`` is used by the first
send only (a re-send must arrive). :data:`LOCAL_OPTIONS` (the producer or connection to send
with) are the sending process's and are not stored; any other option is refused.

An ``eta`` with a timezone is stored as its UTC instant; a naive one is read as UTC, as Celery's
worker reads a naive ``eta`` (``maybe_make_aware``: naive as UTC).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session

from celery_fence.adapters import unique as unique_jobs
from celery_fence.adapters.request import encode_request
from celery_fence.adapters.task import FencedTask
from celery_fence.announce import tracing
from celery_fence.durable import sends
from celery_fence.errors import ConfigurationError
from celery_fence.schema import KEY_LENGTH, valid_key
from celery_fence.store.urls import different_database

logger = logging.getLogger("celery_fence.durable")


#: ``apply_async`` options stored with the job and given to every re-send as they were given to
#: the first send (under the execution options of its stored request).
PUBLISH_OPTIONS = (
    "serializer",
    "compression",
    "retry",
    "retry_policy",
    "delivery_mode",
    "ignore_result",
)
#: Options stored with the job in the shape of the message (its routing and workflow).
_MESSAGE_OPTIONS = (
    "queue",
    "exchange",
    "routing_key",
    "priority",
    "link",
    "link_error",
    "time_limit",
    "soft_time_limit",
    "headers",
    "shadow",
    "countdown",
    "eta",
)
#: Options of the sending process, not of the message: used by the first send, not stored.
LOCAL_OPTIONS = ("producer", "connection", "publisher", "router", "add_to_parent")
#: Used by the first send only, on purpose: a re-send must arrive (see docs/enqueue.md).
_FIRST_SEND_ONLY = ("expires",)
_ACCEPTED = frozenset(PUBLISH_OPTIONS + _MESSAGE_OPTIONS + LOCAL_OPTIONS + _FIRST_SEND_ONLY)


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


def enqueue(
    conn: sa.Connection | Session | scoped_session[Any],
    task: Any,
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    key: str | None = None,
    unique: bool | str | None = None,
    on_conflict: str | None = None,
    **options: Any,
) -> Enqueued:
    """Write ``task(*args, **kwargs)`` as a ``pending`` job in ``conn``'s transaction and send
    it when that transaction commits. ``options`` are ``apply_async``'s (countdown, eta, queue,
    priority, headers, expires, task_id, serializer, compression, retry_policy, ...). See the
    module docstring.

    ``key``: the job's fence key, when it is not the task's (its ``fence_key(*args, **kwargs)``,
    else the task id): the message carries it, and so does every re-send (the beat scheduler
    enqueues each tick under its tick key).

    ``unique``: True (the task's uniqueness key, :func:`~celery_fence.adapters.unique.policy_for`),
    a uniqueness key, False, or None (as the task declares with ``fence_unique``): while an
    unfinished job holds the key, ``on_conflict`` says what this call does: ``"return"`` that
    job (``created`` false), ``"replace"`` it while nobody has claimed it, or ``"raise"``
    :class:`~celery_fence.errors.AlreadyEnqueued`. See :mod:`celery_fence.adapters.unique`."""
    if conn is None:  # (celery_fence.enqueue(None, ...), deprecated, goes to Django's enqueue)
        raise ConfigurationError(
            "celery_fence.durable.enqueue(None, ...): Django's connection is "
            "celery_fence.contrib.django.enqueue(task, ...)'s; pass an SQLAlchemy Connection or "
            "Session here"
        )
    if isinstance(conn, scoped_session):  # Flask-SQLAlchemy's db.session: this thread's Session
        conn = conn()
    session_or_connection = conn
    return enqueue_on(
        lambda store: _SqlAlchemyTarget(session_or_connection, store),
        task,
        args,
        kwargs,
        key=key,
        unique=unique,
        on_conflict=on_conflict,
        **options,
    )


def enqueue_on(
    target_for: Callable[[Any], Target],
    task: Any,
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    key: str | None = None,
    unique: bool | str | None = None,
    on_conflict: str | None = None,
    **options: Any,
) -> Enqueued:
    """:func:`enqueue` on the :class:`Target` ``target_for(store)`` makes (the row's
    connection and the send after its commit): an SQLAlchemy one here, Django's in
    :mod:`celery_fence.contrib.django.durable`."""
    if not isinstance(task, FencedTask):
        raise ConfigurationError(
            f"enqueue() takes a fenced task (@app.task(base=FencedTask, ...)), not "
            f"{getattr(task, 'name', type(task).__name__)!r}: only a fenced job has a row to "
            "write"
        )
    args, kwargs = tuple(args), dict(kwargs or {})
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    check_options(task, options)
    _with_trace(options)
    due = _due(options)
    key = task.logical_key(args, kwargs, task_id) if key is None else _checked_key(task, key)
    policy = task.unique_policy(args, kwargs, unique=unique, on_conflict=on_conflict)
    store = task.fence_backends().store
    target = target_for(store)
    if policy is not None and not isinstance(target, _SqlAlchemyTarget):
        raise ConfigurationError(
            f"enqueue({task.name}, unique=...) on Django's connection: unique jobs are written "
            "through SQLAlchemy for now; enqueue on a Connection or Session of the store's "
            "database, or send with task.apply_async() (a unique task's send is unique too)"
        )
    request = encode_request(
        task.name, args, kwargs, _context(task, args, kwargs, task_id, options)
    )
    if request is None:
        raise ConfigurationError(
            f"enqueue({task.name}): the arguments are not JSON, so the job cannot be stored to "
            "be re-sent; pass plain dicts, lists, str, int, float, bool or None"
        )
    request = _with_publish_options(task, request, options, due)
    if policy is not None:
        assert isinstance(target, _SqlAlchemyTarget)
        claimed = unique_jobs.claim(
            store,
            target.connection,
            key,
            task_name=task.name,
            request=request,
            due=due,
            policy=policy,
            take_over=unique_jobs.taking_over(task, store, target.connection),
        )
        holder = claimed.existing
        created = claimed.created
        status = None if holder is None else holder.status
        stored = None if holder is None else holder.request
        if holder is not None:
            key = holder.key
    else:
        created, status, stored = target.insert(key, task.name, request, due)
    if not created:
        stored_id = (stored or {}).get("id")
        return Enqueued(
            key=key,
            task_id=str(stored_id or task_id),
            created=False,
            status=status or "unknown",
            task=task,
        )
    target.after_commit(sends.Send(task, key, task_id, args, kwargs, options))
    return Enqueued(key=key, task_id=task_id, created=True, status="pending", task=task)


class Target(Protocol):
    """Where the job's row is written, and what sends its message after the commit."""

    def insert(
        self, key: str, task_name: str, request: Mapping[str, Any], due: dt.datetime | None
    ) -> tuple[bool, str | None, Mapping[str, Any] | None]:
        """``(True, None, None)``: written; ``(False, status, request)``: the key's job."""

    def after_commit(self, send: sends.Send) -> None:
        """Send once the transaction commits; forget it when it rolls back
        (:func:`~celery_fence.durable.sends.publish`)."""


class _SqlAlchemyTarget:
    def __init__(self, conn: Any, store: Any) -> None:
        self.conn = conn
        self.store = store
        self.connection = _connection_of(conn)
        _check_same_database(store.url, self.connection.engine.url)

    def insert(
        self, key: str, task_name: str, request: Mapping[str, Any], due: dt.datetime | None
    ) -> tuple[bool, str | None, Mapping[str, Any] | None]:
        created, existing = self.store.pending.insert(
            self.connection, key, task_name=task_name, request=request, due=due
        )
        if created or existing is None:
            return created, None, None
        return False, existing.status, existing.request

    def after_commit(self, send: sends.Send) -> None:
        # On the Connection, for a Session too: a Session joined to an outer transaction
        # (Session(bind=conn) inside conn.begin()) commits nothing of it at session.commit();
        # the row commits with the connection's outermost transaction, and so goes the message.
        sends.after_commit(self.connection, send)


def _checked_key(task: Any, key: Any) -> str:
    if not valid_key(key):
        raise ConfigurationError(
            f"enqueue({task.name}, key=...): a key must be a non-empty str of at most "
            f"{KEY_LENGTH} characters without NUL (\\x00), not a {type(key).__name__} "
            f"({len(key) if isinstance(key, str) else '-'} chars)"
        )
    return key


def check_options(task: Any, options: Mapping[str, Any]) -> None:
    """Refuse (:class:`ConfigurationError`) the options :func:`enqueue` cannot keep with the
    job (the beat scheduler checks its entries' options with it when it starts)."""
    unknown = sorted(set(options) - _ACCEPTED)
    if unknown:
        raise ConfigurationError(
            f"enqueue({task.name}): the option(s) {', '.join(unknown)} cannot be kept with the "
            "job, so a re-send by fence recover or fence requeue would publish a different "
            "message; enqueue() takes "
            f"{', '.join(sorted(_ACCEPTED - set(LOCAL_OPTIONS)))} (and task_id), plus the "
            f"sending process's {', '.join(LOCAL_OPTIONS)}. Send with task.apply_async() for "
            "the others."
        )


def _with_publish_options(
    task: Any, request: dict[str, Any], options: Mapping[str, Any], due: dt.datetime | None
) -> dict[str, Any]:
    """The stored request with what a re-send needs besides its workflow: the
    :data:`PUBLISH_OPTIONS` given, and the due time as the ``eta`` (a UTC instant)."""
    kept = {name: options[name] for name in PUBLISH_OPTIONS if options.get(name) is not None}
    if due is not None:
        kept["eta"] = due.isoformat()
    if not kept:
        return request
    try:
        json.dumps(kept, allow_nan=False)
    except (TypeError, ValueError):
        names = ", ".join(sorted(kept))
        raise ConfigurationError(
            f"enqueue({task.name}): the options {names} must be JSON (they are stored with the "
            "job, so a re-send publishes the message as the first send did)"
        ) from None
    execution = dict(request.get("execution") or {})
    execution.update(kept)
    return {**request, "execution": execution}


def _with_trace(options: dict[str, Any]) -> None:
    """The caller's trace context as the message's ``traceparent`` header (with
    ``opentelemetry-api`` and a current span, unless the caller set one): stored with the row's
    request, so every attempt and re-send of the job is in the caller's trace."""
    if not tracing.ENABLED:
        return
    headers = dict(options.get("headers") or {})
    if tracing.TRACEPARENT in headers:
        return
    tracing.inject(headers)
    if tracing.TRACEPARENT in headers:
        options["headers"] = headers


#: Kept here under their old names (the tests and the chaos harness read them).
_due = unique_jobs.due_time
_context = unique_jobs.message_context


def _connection_of(conn: Any) -> sa.Connection:
    if isinstance(conn, (Session, sa.Connection)) and conn.in_nested_transaction():
        raise _savepoint_refused()
    if isinstance(conn, Session):
        connection = conn.connection()
    elif isinstance(conn, sa.Connection):
        if not conn.in_transaction():
            raise ConfigurationError(
                "enqueue(conn, ...) needs a connection in a transaction (with engine.begin() as "
                "conn:): the job's row must commit or roll back with your data"
            )
        connection = conn
    else:
        raise ConfigurationError(
            f"enqueue() takes an SQLAlchemy Connection or Session, not {type(conn).__name__}"
        )
    if connection.in_nested_transaction():  # a Session that joined its bind with a savepoint
        raise _savepoint_refused()
    if _autocommits(connection):
        raise ConfigurationError(
            "enqueue(conn, ...) on a connection in AUTOCOMMIT (an engine created with "
            "isolation_level='AUTOCOMMIT', or that execution option; the fence store's own "
            "engine is one): each statement commits on its own, so the job's row would be "
            "committed at once, and kept (its message unsent) after your transaction rolls back. "
            "Enqueue on a connection of your app's engine without isolation_level='AUTOCOMMIT' "
            "(with engine.begin() as conn:), in the transaction that writes your data."
        )
    return connection


def _savepoint_refused() -> ConfigurationError:
    return ConfigurationError(
        "enqueue() inside a savepoint (begin_nested(), or a Session joined to its connection's "
        "transaction with a savepoint): enqueue in the outer transaction, whose commit sends the "
        "message (a rolled-back savepoint would leave a message without its row)"
    )


def _autocommits(connection: sa.Connection) -> bool:
    """Whether the driver's connection commits each statement on its own: psycopg's and
    psycopg2's ``autocommit``; on SQLite, no transaction begun and none to be begun (SQLAlchemy's
    AUTOCOMMIT sets ``isolation_level`` None; a fenced block on SQLite has begun its own)."""
    dbapi = connection.connection.dbapi_connection
    if isinstance(dbapi, sqlite3.Connection):
        if dbapi.in_transaction:
            return False
        return dbapi.isolation_level is None or getattr(dbapi, "autocommit", None) is True
    return getattr(dbapi, "autocommit", False) is True


def _check_same_database(store_url: str, theirs: sa.URL) -> None:
    ours = sa.engine.make_url(store_url)
    reason = different_database(ours, theirs)
    if reason is not None:
        raise ConfigurationError(
            f"enqueue(conn, ...): the connection is on {theirs.render_as_string()}, not on the "
            f"fence store's database {ours.render_as_string()} ({reason}); the job's row must be "
            "written in your transaction: set fence_database_url to your app's database"
        )


__all__ = [
    "LOCAL_OPTIONS",
    "PUBLISH_OPTIONS",
    "Enqueued",
    "Target",
    "check_options",
    "enqueue",
    "enqueue_on",
]
