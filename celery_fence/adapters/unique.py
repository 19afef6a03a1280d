"""Unique jobs: one unfinished job per uniqueness key, held by the job's row, not by a TTL.

A job written with a uniqueness key (``enqueue(conn, task, ..., unique=True)``, or any send of a
task declared with ``fence_unique``) carries it in ``fence_jobs.unique_key``; a partial unique
index admits one ``pending``, ``running`` or ``retrying`` job per key, so the store itself
refuses a second one, in the transaction that writes it. The key is released by the job's own
end (completed, dead): a worker killed mid-run leaves its job ``running``; once its lease runs
out (at most one TTL after the kill) the job is stranded, and the workers' recovery check (every
``fence_recover_interval``, half a TTL) re-sends it, or at once the next send of its key
(:func:`take_over`): it runs again within one TTL of its lease's end. The key stays held by that
one job until it ends — nothing waits for a lock to expire, and no later send is silently
dropped.

Policy, per task (``fence_unique_*`` options) or per call (``enqueue(..., unique=...,
on_conflict=...)``):

- ``states``: the states in which the holder keeps the key (default all three unfinished ones).
  A holder outside them (``("pending",)``: a job that has started) gives its key up to the new
  job, which then runs beside it.
- ``period``: seconds after which the holder gives its key up whatever its state (an upper bound
  for a job that is known to finish; never needed to release a dead worker's job).
- ``on_conflict``: ``"return"`` the holder (its task id, its ``AsyncResult``), ``"raise"``
  :class:`~celery_fence.errors.AlreadyEnqueued`, or ``"replace"`` a holder nobody has claimed
  yet (it ends ``dead``, reason ``replaced``; its message, when a worker gets it, is acked
  without running). A holder that has started cannot be replaced: ``"replace"`` raises.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import sqlite3
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa

from celery_fence.actions import LogAction
from celery_fence.errors import AlreadyEnqueued, ConfigurationError, FenceError
from celery_fence.ops import recovery
from celery_fence.ops.scope import Scope
from celery_fence.schema import KEY_LENGTH, PENDING, RETRYING, RUNNING, as_utc, utcnow
from celery_fence.store import JobRecord, Store

logger = logging.getLogger("celery_fence.unique")

#: The states in which a unique job holds its key, by default: all the unfinished ones.
UNIQUE_STATES = (PENDING, RUNNING, RETRYING)
#: What a send does when an unfinished job holds its uniqueness key.
ON_CONFLICT = ("return", "replace", "raise")
DEFAULT_ON_CONFLICT = "return"
#: Conflicts resolved (a holder released or replaced) before a send gives up: each pass is one
#: statement, and another sender can take the key between two.
_PASSES = 4


@dataclass(frozen=True)
class UniquePolicy:
    """A send's uniqueness: its ``key``, the ``states`` in which a holder keeps it, the
    ``period`` (seconds, or None) after which a holder gives it up, and ``on_conflict``."""

    key: str
    states: tuple[str, ...] = UNIQUE_STATES
    period: float | None = None
    on_conflict: str = DEFAULT_ON_CONFLICT


@dataclass(frozen=True)
class Claimed:
    """What :func:`claim` did: ``created`` the job's row, or found ``existing`` (the key's own
    job, or the unfinished holder of the uniqueness key)."""

    created: bool
    existing: JobRecord | None = None


def policy_for(
    task: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    unique: bool | str | None = None,
    on_conflict: str | None = None,
) -> UniquePolicy | None:
    """The uniqueness of one send of ``task``: ``unique`` (True: the task's uniqueness key;
    a str: that key; False: none; None: as the task declares with ``fence_unique``) and
    ``on_conflict`` (None: the task's ``fence_unique_on_conflict``). None when not unique."""
    declared = _class_option(task, "fence_unique")
    wanted = declared if unique is None else unique
    if wanted is None or wanted is False:
        if on_conflict is not None:
            raise ConfigurationError(
                f"{task.name}: on_conflict={on_conflict!r} without a uniqueness key; pass "
                "unique=True (or a key), or declare the task with fence_unique=True"
            )
        return None
    if isinstance(wanted, str):
        key = wanted
    elif wanted is True:
        key = default_unique_key(task.name, args, kwargs)
    elif callable(wanted):
        key = _called_key(task, wanted, args, kwargs)
    else:
        raise ConfigurationError(
            f"{task.name}: unique / fence_unique must be True, a key (str) or a callable given "
            f"the task's args and kwargs, not {type(wanted).__name__}"
        )
    if not key or len(key) > KEY_LENGTH:
        raise ConfigurationError(
            f"{task.name}: the uniqueness key must be 1 to {KEY_LENGTH} characters (got {len(key)})"
        )
    return UniquePolicy(
        key=key,
        states=_states(task, getattr(task, "fence_unique_states", None)),
        period=_period(task, getattr(task, "fence_unique_period", None)),
        on_conflict=_on_conflict(
            task,
            on_conflict
            if on_conflict is not None
            else getattr(task, "fence_unique_on_conflict", None) or DEFAULT_ON_CONFLICT,
        ),
    )


def _class_option(task: Any, name: str) -> Any:
    """A task option as given to ``@app.task`` (a class attribute): a callable as itself, not
    bound to the task as a method would be."""
    unwrap = getattr(task, "_get_current_object", None)  # a lazy task proxy
    for klass in type(task if unwrap is None else unwrap()).__mro__:
        if name in klass.__dict__:
            raw = klass.__dict__[name]
            return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return None


def default_unique_key(
    task_name: str,
    args: Iterable[Any],
    kwargs: Mapping[str, Any],
    *,
    keys: Iterable[str] | None = None,
) -> str:
    """``task_name:`` and the SHA-256 of the arguments as canonical JSON (with ``keys``, only
    those kwargs): the arguments themselves never reach the key, its column, or an error message
    (a key is logged; arguments never are). Give ``fence_unique`` a callable for a readable key."""
    if keys is None:
        shape: Any = [list(args), dict(sorted(kwargs.items()))]
    else:
        shape = {name: kwargs.get(name) for name in sorted(keys)}
    try:
        text = json.dumps(shape, sort_keys=True, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"{task_name}: the arguments cannot make a uniqueness key; give fence_unique a "
            "callable that returns one"
        ) from None
    return f"{task_name}:{hashlib.sha256(text.encode()).hexdigest()}"


def _called_key(
    task: Any, make: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str:
    try:
        key = make(*args, **kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"fence_unique of task {task.name} raised {type(exc).__name__}; it is called with "
            "the task's args and kwargs and returns the uniqueness key"
        ) from exc
    if not isinstance(key, str):
        raise ConfigurationError(
            f"fence_unique of task {task.name} returned a {type(key).__name__}, not a str"
        )
    return key


def _states(task: Any, states: Any) -> tuple[str, ...]:
    if states is None:
        return UNIQUE_STATES
    chosen = (states,) if isinstance(states, str) else tuple(states)
    wrong = [s for s in chosen if s not in UNIQUE_STATES]
    if not chosen or wrong:
        raise ConfigurationError(
            f"{task.name}: fence_unique_states={states!r}; give some of "
            f"{', '.join(UNIQUE_STATES)} (a finished job never holds its key)"
        )
    return chosen


def _period(task: Any, period: Any) -> float | None:
    if period is None:
        return None
    if isinstance(period, dt.timedelta):
        period = period.total_seconds()
    if isinstance(period, bool) or not isinstance(period, (int, float)) or period <= 0:
        raise ConfigurationError(
            f"{task.name}: fence_unique_period={period!r} must be a positive number of seconds "
            "(or None: held until the job ends)"
        )
    return float(period)


def _on_conflict(task: Any, value: Any) -> str:
    if value not in ON_CONFLICT:
        raise ConfigurationError(
            f"{task.name}: on_conflict={value!r}; give one of {', '.join(ON_CONFLICT)}"
        )
    return str(value)


def claim(
    store: Store,
    conn: sa.Connection,
    key: str,
    *,
    task_name: str,
    request: Mapping[str, Any],
    due: dt.datetime | None,
    policy: UniquePolicy | None,
    take_over: Callable[[JobRecord], JobRecord] | None = None,
) -> Claimed:
    """Write job ``key`` as ``pending`` on ``conn`` (the caller's transaction, or the store's
    own connection: each statement commits) under ``policy``: :class:`Claimed`, or
    :class:`AlreadyEnqueued` (``on_conflict="raise"``, or a started holder to replace). A
    ``running`` holder goes through ``take_over`` first (:func:`take_over`: re-sent at once
    when its lease is gone), whatever ``on_conflict`` then does with it."""
    if policy is None:
        created, existing = store.pending.insert(
            conn, key, task_name=task_name, request=request, due=due
        )
        return Claimed(created, existing)
    for _ in range(_PASSES):
        created, holder = store.pending.insert(
            conn, key, task_name=task_name, request=request, due=due, unique_key=policy.key
        )
        if created:
            return Claimed(True)
        if holder is None or holder.key == key or holder.unique_key != policy.key:
            return Claimed(False, holder)  # the key's own job: the same job sent again
        if holder.status not in policy.states or _period_over(holder, policy.period):
            store.pending.release_unique(
                conn, holder.key, unique_key=policy.key, status=holder.status
            )
            continue
        if holder.status == RUNNING and take_over is not None:
            holder = take_over(holder)
        if policy.on_conflict == "return":
            return Claimed(False, holder)
        if policy.on_conflict == "replace" and holder.status == PENDING and holder.generation == 0:
            store.pending.replace(conn, holder.key, unique_key=policy.key)
            continue
        raise already_enqueued(holder, policy)
    raise FenceError(
        f"unique job {policy.key!r}: the key changed hands {_PASSES} times while this send "
        "resolved its conflict; send again"
    )


def take_over(task: Any, store: Store, holder: JobRecord) -> JobRecord:
    """A ``running`` holder whose lease is gone from Redis, met by a send of its uniqueness key:
    its attempt died or froze past its lease (a killed worker: on the Redis broker its message
    comes back only after the visibility timeout), so it is re-sent now, under its key and task
    id, as recovery would (:func:`~celery_fence.ops.recovery.resend`: a compare-and-set to
    ``pending`` on the row as read, then the send), rather than waiting for the next recovery
    check. The row was read before the lease (a claim takes its lease before it registers), so
    a job just claimed is never taken. Returns the holder as it is now: ``pending`` when this
    send re-sent it, else as read (its lease is live, it moved meanwhile, or the re-send
    failed: the workers' recovery check sends it)."""
    if holder.status != RUNNING or not holder.request or _lease_held(task, holder):
        return holder
    try:
        sent = recovery.resend_announced(
            task.app, store, holder, reason="stranded running, met by a unique send"
        )
    except Exception as exc:  # the send still answers with its holder; recovery retries
        logger.warning(
            "fence unique send could not take over key=%s: %s",
            holder.key,
            type(exc).__name__,
            extra={"action": LogAction.RECOVER_FAILED, "fence_key": holder.key},
        )
        return holder
    if sent is None:
        return holder
    return dataclasses.replace(holder, status=PENDING, updated_at=utcnow(), retry_at=None)


def taking_over(
    task: Any, store: Store, connection: sa.Connection
) -> Callable[[JobRecord], JobRecord]:
    """How :func:`~celery_fence.enqueue` takes over a ``running`` holder whose lease is gone
    (:func:`take_over`, on the store's own connection); not on SQLite inside the caller's
    transaction, whose write lock that connection would wait on (the workers' recovery check
    re-sends it instead, within its interval)."""

    def take(holder: JobRecord) -> JobRecord:
        dbapi = connection.connection.dbapi_connection  # judged after the insert began it
        if isinstance(dbapi, sqlite3.Connection) and dbapi.in_transaction:
            return holder
        return take_over(task, store, holder)

    return take


def _lease_held(task: Any, holder: JobRecord) -> bool:
    """Whether a live lease holds the holder's key, where its own task claims it."""
    if str((holder.request or {}).get("task") or holder.task_name) == task.name:
        return task.fence_backends().leases.remaining(holder.key)[0] is not None
    with Scope(task.app) as scope:  # another task's job holds the key: its Redis and prefix
        return scope.lease_held(holder)


def already_enqueued(holder: JobRecord, policy: UniquePolicy) -> AlreadyEnqueued:
    started = policy.on_conflict == "replace"
    why = (
        "it has started, so it cannot be replaced (replace ends a job nobody has claimed yet)"
        if started
        else "on_conflict='raise'"
    )
    return AlreadyEnqueued(
        f"unique job {policy.key!r} is already {holder.status} as job {holder.key!r}: {why}; "
        "it is released when that job ends",
        key=holder.key,
        unique_key=policy.key,
        status=holder.status,
        task_id=task_id_of(holder),
    )


def task_id_of(record: JobRecord) -> str | None:
    """The task id of the message that job ``record`` was stored with."""
    stored = (record.request or {}).get("id")
    return None if stored is None else str(stored)


def _period_over(holder: JobRecord, period: float | None) -> bool:
    if period is None:
        return False
    return utcnow() - as_utc(holder.created_at) > dt.timedelta(seconds=period)


# -- the message's shape (enqueue's and a unique send's stored request) --------------------------


def message_context(
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


def due_time(options: Mapping[str, Any]) -> dt.datetime | None:
    """When the message's countdown or eta lets it run, as a UTC instant, or None: recovery does
    not send a job early, and a re-send carries it as its ``eta``. An aware ``eta`` in any zone
    is converted to UTC (SQLite keeps no offset); a naive one is UTC, as Celery's worker reads a
    naive ``eta``."""
    if options.get("countdown") is not None:  # Celery's apply_async: a countdown wins
        return utcnow() + dt.timedelta(seconds=float(options["countdown"]))
    eta = options.get("eta")
    if eta is None:
        return None
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            raise ConfigurationError(
                f"enqueue(): eta={eta!r} is not an ISO 8601 datetime; pass a datetime"
            ) from None
    if not isinstance(eta, dt.datetime):
        raise ConfigurationError(
            f"enqueue(): eta must be a datetime (or its ISO 8601 text), not {type(eta).__name__}"
        )
    if eta.tzinfo is None or eta.utcoffset() is None:
        return eta.replace(tzinfo=dt.timezone.utc)
    return eta.astimezone(dt.timezone.utc)


def new_task_id() -> str:
    return str(uuid.uuid4())


__all__ = [
    "DEFAULT_ON_CONFLICT",
    "ON_CONFLICT",
    "UNIQUE_STATES",
    "Claimed",
    "UniquePolicy",
    "claim",
    "default_unique_key",
    "policy_for",
    "take_over",
    "taking_over",
]
