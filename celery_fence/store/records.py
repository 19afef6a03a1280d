"""The values the store hands out and takes in: job records, transitions, registrations, the
endings of a job (:data:`Ending`), staged effects, and the request kept with a job (as sent, also
when the database refused it as is).

No SQL here: :mod:`celery_fence.store` runs every statement.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from celery_fence.errors import ResultNotSerializable
from celery_fence.schema import PENDING, RETRYING, RUNNING

#: What a registration found (:attr:`Registration.outcome`).
RegistrationOutcome = Literal["registered", "completed", "dead", "stale"]


@dataclass(frozen=True)
class JobRecord:
    """One logical job as the store knows it."""

    key: str
    task_name: str
    status: str
    generation: int
    attempt_id: str
    attempts: int
    result: Any
    request: Mapping[str, Any] | None
    error_type: str | None
    error_message: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None
    retry_at: dt.datetime | None
    #: The uniqueness key of a unique job (``enqueue(unique=...)``, ``fence_unique``), else None.
    unique_key: str | None = None


def never_claimed(record: JobRecord) -> bool:
    """True for a job no attempt has claimed yet: enqueued (:func:`celery_fence.enqueue`) and
    waiting for its first run, ``pending`` at generation 0."""
    return record.status == PENDING and record.generation == 0


@dataclass(frozen=True)
class Transition:
    key: str
    generation: int | None
    attempt_id: str | None
    action: str
    reason: str | None
    at: dt.datetime


@dataclass(frozen=True)
class Registration:
    """What :meth:`Store.register` found: run the body only when ``outcome == "registered"``."""

    outcome: RegistrationOutcome
    attempts: int
    stored_generation: int
    record: JobRecord | None = None
    #: The operator's re-run the job row's stored request is numbered for (its ``fence_run``;
    #: 0: none), returned by the registration itself: a late message without the header (the
    #: key's first message, redelivered after ``fence requeue --completed``) still runs as it.
    run: int = 0
    #: When the registration took over a row another attempt of an older generation had left
    #: ``running``: when that row last moved (its registration, or its last fenced commit); None
    #: otherwise. PostgreSQL's registration always returns it; SQLite's when asked (a read first).
    took_over_from: dt.datetime | None = None


@dataclass(frozen=True)
class Effect:
    """An external effect staged by a task body, written with the fenced completion."""

    name: str
    payload: Any
    idempotency_key: str


# -- the endings of a job ------------------------------------------------------------------------
#
# Every way a job ends is one value, applied by one store method
# (:meth:`celery_fence.store.Store.end`), each through its one statement. The fenced ones
# (:data:`FENCED_ENDINGS`) name the attempt they are fenced on (``generation``, ``attempt_id``)
# and raise :class:`~celery_fence.errors.StaleGeneration` when the row is not theirs to end.


@dataclass(frozen=True)
class Completion:
    """The result and ``completed``, where this attempt still owns the running row; the staged
    ``effects`` in the same statement. ``clear_steps``: the job's steps and checkpoint
    (``fence_steps``) deleted in the same statement or transaction (the attempt used them)."""

    generation: int
    attempt_id: str
    result: Any
    effects: Sequence[Effect] = ()
    clear_steps: bool = False


@dataclass(frozen=True)
class RetryScheduled:
    """``retrying`` until ``retry_at``, where this attempt still owns the running row."""

    generation: int
    attempt_id: str
    error: BaseException | None
    retry_at: dt.datetime
    reason: str


@dataclass(frozen=True)
class Dead:
    """The terminal ``dead`` state, where this attempt still owns the running row.
    ``attempts``, when given, is the number of executions to keep (a delivery that only found
    the budget spent was counted by its registration but ran nothing)."""

    generation: int
    attempt_id: str
    error: BaseException | None
    reason: str
    attempts: int | None = None


@dataclass(frozen=True)
class CallerFailed:
    """``failed``, where this attempt still owns the running row: an attempt run in the
    caller's thread (a direct call, ``.apply()``, an eager run) raised to its caller. No message
    waits for it, so recovery leaves it (``failed`` is not unfinished); the next call or message
    for the key registers over it (a live status: a newer generation takes it, its attempt count
    starting again)."""

    generation: int
    attempt_id: str
    error: BaseException | None
    reason: str


@dataclass(frozen=True)
class DeadRefused:
    """A registration the database refused (its request holds a value the column cannot store):
    ``dead`` at once, fenced like a registration (only over a row with an older generation that
    is neither completed nor dead), the request kept as JSON text inside a JSON string
    (``{"encoded": "..."}``), which every database accepts."""

    generation: int
    attempt_id: str
    task_name: str
    request_json: str | None
    error: BaseException
    reason: str


@dataclass(frozen=True)
class DeadUnregistered:
    """A message that cannot even be registered (e.g. its ``fence_key`` failed) kept as a
    ``dead`` job, so nothing is lost. Inserted; an existing row is taken only when it is
    ``pending`` (an operator re-sent this message and its key failed again). Not fenced on an
    attempt (there is none): :meth:`~celery_fence.store.Store.end` returns whether it wrote."""

    task_name: str
    request: Mapping[str, Any] | None
    error: BaseException
    reason: str


@dataclass(frozen=True)
class DeadUnrun:
    """A message Celery acks without running it to its end (``reason``: expired, revoked, or
    revoked with ``terminate=True`` while it ran).

    No row yet: the job is recorded ``dead`` with its request. A row that waits for
    this message (``retrying`` or ``pending``) goes ``dead`` by compare-and-set on the state just
    read; with ``only_insert`` (other messages may share the key), only when its stored request
    has this message's task id ``message_id`` (the job's own message, e.g. its retry).
    ``terminated_id``: the Celery task id of a message whose attempt was terminated; a row still
    unfinished under that message (its stored request has that id) goes ``dead`` too. Any other
    row keeps its state; the transition is recorded (and ``end`` returns False)."""

    task_name: str
    request: Mapping[str, Any] | None
    reason: str
    only_insert: bool = False
    terminated_id: str | None = None
    message_id: str | None = None

    def waits_for(self, record: JobRecord) -> bool:
        """Whether ``record`` is the job of the message this ending settles."""
        stored_id = (record.request or {}).get("id")
        if self.terminated_id is not None and record.status in (RUNNING, RETRYING, PENDING):
            return bool(stored_id == self.terminated_id)
        if record.status not in (RETRYING, PENDING):
            return False
        return not self.only_insert or (
            self.message_id is not None and stored_id == self.message_id
        )


@dataclass(frozen=True)
class DeadStranded:
    """An unfinished job that cannot be re-sent (no stored request) moved to ``dead`` by
    recovery, by compare-and-set on ``record`` as it was read (status, generation, attempt and
    ``updated_at``): ``end`` returns False when it moved meanwhile."""

    record: JobRecord
    error: BaseException
    reason: str


#: Every way a job ends (:meth:`celery_fence.store.Store.end`).
Ending: TypeAlias = (
    Completion
    | RetryScheduled
    | Dead
    | CallerFailed
    | DeadRefused
    | DeadUnregistered
    | DeadUnrun
    | DeadStranded
)
#: The endings fenced on an attempt: :class:`~celery_fence.errors.StaleGeneration` when the row
#: is not that attempt's to end.
FENCED_ENDINGS = (Completion, RetryScheduled, Dead, CallerFailed, DeadRefused)


def dumps_strict(value: Any, what: str = "value") -> str:
    """JSON or a clear error; never a lossy conversion (no NaN, no ``default=str``)."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ResultNotSerializable(
            f"the {what} is not JSON ({exc}); return plain dicts, lists, str, int, float, bool "
            "or None, e.g. convert dates with .isoformat()"
        ) from None


#: The stored request of a job whose arguments the database refused: ``{"encoded": "<json>"}``.
ENCODED_REQUEST = "encoded"
#: The header of the message :func:`celery_fence.enqueue` publishes after the caller's commit:
#: the first delivery of a job whose ``pending`` row exists (re-sends do not carry it).
ENQUEUED_HEADER = "fence_enqueued"
#: The header of an operator's re-run of a completed key (``fence requeue --completed``): its
#: number, 1, 2, ... It is stored with the job's request (``execution.headers``), so recovery's
#: re-sends and Celery's retries carry it too; the run's outbox effects get idempotency keys of
#: their own (:func:`celery_fence.body.effects.idempotency_key`).
RUN_HEADER = "fence_run"
#: The header of a recovery's re-send of a job whose attempt never ended:
#: ``{"generation": g, "moved": <epoch seconds of the row's last move>}``; the new attempt sends
#: ``job_taken_over`` from it. Never stored with a request (a later re-send is no takeover).
TAKEOVER_HEADER = "fence_takeover"


def run_of(request: Mapping[str, Any] | None) -> int:
    """The re-run number a stored request carries (0: none, the key's first run)."""
    headers = ((request or {}).get("execution") or {}).get("headers") or {}
    value = headers.get(RUN_HEADER) if isinstance(headers, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def run_value(value: Any) -> int:
    """A ``fence_run`` value as a run number: a positive integer (or its decimal text, as
    PostgreSQL's ``#>>`` returns it), else 0."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def with_run(request: Mapping[str, Any], run: int) -> dict[str, Any]:
    """``request`` with its :data:`RUN_HEADER` set to ``run``."""
    execution = dict(request.get("execution") or {})
    execution["headers"] = {**dict(execution.get("headers") or {}), RUN_HEADER: run}
    return {**request, "execution": execution}


def decode_request(request: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The request as sent (task, args, kwargs, options, execution), also when it was stored
    encoded."""
    if request is not None and set(request) == {ENCODED_REQUEST}:
        decoded: Mapping[str, Any] = json.loads(request[ENCODED_REQUEST])
        return decoded
    return request


#: What a stored request keeps of the message, besides task, id, args, kwargs and routing, so
#: that a re-send (``fence recover``, ``fence requeue``) carries the workflow on: the options
#: Celery's own ``Task.retry`` re-sends with (``Context.as_execution_options``), named as
#: ``send_task`` takes them, except ``expires`` (a re-send must arrive) and ``retries``;
#: how the message was published (``serializer``, ``compression``, ``delivery_mode``: a
#: worker's request, :func:`celery_fence.adapters.request.message_publish_options`); and, for a job
#: :func:`celery_fence.enqueue` wrote, its due time as ``eta`` (ISO 8601, UTC) and the publish
#: options it was given (:data:`celery_fence.durable.PUBLISH_OPTIONS`, also ``retry`` and
#: ``retry_policy``, which are the producer's and never reach a worker).
EXECUTION_OPTIONS = (
    "chain",
    "link",
    "link_error",
    "chord",
    "group_id",
    "group_index",
    "root_id",
    "parent_id",
    "shadow",
    "time_limit",
    "soft_time_limit",
    "reply_to",
    "replaced_task_nesting",
    "ignore_result",
    "headers",
    "stamped_headers",
    "stamps",
    "eta",
    "serializer",
    "compression",
    "retry",
    "retry_policy",
    "delivery_mode",
)


def job_record(row: Any) -> JobRecord:
    m = row._mapping
    fields = {name: m[name] for name in JobRecord.__dataclass_fields__ if name != "unique_key"}
    fields["unique_key"] = m.get("unique_key")  # absent from the raw path's narrower RETURNING
    fields["request"] = decode_request(fields["request"])  # as sent, also when stored encoded
    return JobRecord(**fields)
