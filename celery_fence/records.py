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


def decode_request(request: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The request as sent (task, args, kwargs, options), also when it was stored encoded."""
    if request is not None and set(request) == {ENCODED_REQUEST}:
        decoded: Mapping[str, Any] = json.loads(request[ENCODED_REQUEST])
        return decoded
    return request


def request_text(
    task_name: str, args: Any, kwargs: Any, delivery: Any, task_id: str | None = None
) -> str | None:
    """The request as stored for a requeue (task, Celery task id, args, kwargs, routing as
    delivered: exchange and routing key), as JSON text; None when the arguments are not JSON."""
    delivery = delivery or {}
    routing_key = delivery.get("routing_key") or None
    try:
        return json.dumps(
            {
                "task": task_name,
                "id": task_id,
                "args": list(args or ()),
                "kwargs": dict(kwargs or {}),
                "options": {
                    "exchange": delivery.get("exchange") or None,
                    "routing_key": routing_key,
                    "priority": delivery.get("priority"),
                },
            },
            allow_nan=False,
            separators=(",", ":"),
        )
    except (TypeError, ValueError):
        return None


def encode_request(
    task_name: str, args: Any, kwargs: Any, delivery: Any, task_id: str | None = None
) -> dict[str, Any] | None:
    """:func:`request_text` as a dict (None when the arguments are not JSON)."""
    text = request_text(task_name, args, kwargs, delivery, task_id)
    return None if text is None else dict(json.loads(text))


def job_record(row: Any) -> JobRecord:
    m = row._mapping
    fields = {name: m[name] for name in JobRecord.__dataclass_fields__}
    fields["request"] = decode_request(fields["request"])  # as sent, also when stored encoded
    return JobRecord(**fields)
