"""The values the store hands out and takes in: job records, transitions, registrations, staged
effects, and the request kept with a job (as sent, also when the database refused it as is).

No SQL here: :mod:`celery_fence.store` runs every statement.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ResultNotSerializable
from .schema import PENDING

Outcome = Literal["registered", "completed", "dead", "stale"]


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

    outcome: Outcome
    attempts: int
    stored_generation: int
    record: JobRecord | None = None


@dataclass(frozen=True)
class Effect:
    """An external effect staged by a task body, written with the fenced completion."""

    name: str
    payload: Any
    idempotency_key: str


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
#: ``send_task`` takes them, except ``expires`` (a re-send must arrive) and ``retries``.
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
)


def execution_options(context: Any) -> dict[str, Any]:
    """The :data:`EXECUTION_OPTIONS` of a Celery task request (``Task.request`` in the body, the
    worker request's context), without the unset ones: the shape of Celery's
    ``Context.as_execution_options``, read from the same fields. Custom headers are kept when
    they are JSON (the broker's own ``x-*`` headers never)."""
    get = context.__dict__.get  # a Context keeps the message's fields as instance attributes
    hard, soft = get("timelimit") or (None, None)
    stamped = get("stamped_headers") or None
    stamps = get("stamps") or {}
    kept: dict[str, Any] = {
        "chain": get("chain") or None,
        "link": get("callbacks") or None,
        "link_error": get("errbacks") or None,
        "chord": get("chord") or None,
        "group_id": get("group"),
        "group_index": get("group_index"),
        "root_id": get("root_id"),
        "parent_id": get("parent_id"),
        "shadow": get("shadow"),
        "time_limit": hard,
        "soft_time_limit": soft,
        "reply_to": get("reply_to"),
        "replaced_task_nesting": get("replaced_task_nesting") or None,
        "ignore_result": True if get("ignore_result") is True else None,
        "headers": _json_headers(get("headers")) if get("headers") else None,
        "stamped_headers": stamped,
        "stamps": {k: stamps[k] for k in stamped if k in stamps} if stamped else None,
    }
    return {name: value for name, value in kept.items() if value is not None}


def _json_headers(headers: Any) -> dict[str, Any] | None:
    out = {}
    for name, value in dict(headers or {}).items():
        if str(name).lower().startswith("x-") or name == ENQUEUED_HEADER:
            continue  # (a re-send is never the enqueued first delivery)
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        out[str(name)] = value
    return out or None


def request_text(task_name: str, args: Any, kwargs: Any, context: Any) -> str | None:
    """The request as stored for a re-send, as JSON text: task, Celery task id, args, kwargs,
    routing as delivered (exchange, routing key, priority) and, under ``execution``, the
    workflow (:func:`execution_options`). ``context`` is the Celery task request. None when the
    arguments or the workflow are not JSON (a re-send without its workflow would break it)."""
    delivery = getattr(context, "delivery_info", None) or {}
    doc: dict[str, Any] = {
        "task": task_name,
        "id": getattr(context, "id", None),
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "options": {
            "exchange": delivery.get("exchange") or None,
            "routing_key": delivery.get("routing_key") or None,
            "priority": delivery.get("priority"),
        },
    }
    execution = execution_options(context)
    if execution:
        doc["execution"] = execution
    try:
        return json.dumps(doc, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def encode_request(task_name: str, args: Any, kwargs: Any, context: Any) -> dict[str, Any] | None:
    """:func:`request_text` as a dict (None when it is not JSON)."""
    text = request_text(task_name, args, kwargs, context)
    return None if text is None else dict(json.loads(text))


def job_record(row: Any) -> JobRecord:
    m = row._mapping
    fields = {name: m[name] for name in JobRecord.__dataclass_fields__}
    fields["request"] = decode_request(fields["request"])  # as sent, also when stored encoded
    return JobRecord(**fields)
