"""A Celery task request as a job stores it, for a re-send (``fence recover``, ``fence requeue``):
the task, its id, args, kwargs, routing as delivered, and the workflow under ``execution``
(:data:`~celery_fence.store.records.EXECUTION_OPTIONS`, read from the request the way Celery's
own ``Context.as_execution_options`` reads it). The store keeps and reads the value
(:mod:`celery_fence.store.records`); reading it off Celery's request is Celery's side."""

from __future__ import annotations

import json
from typing import Any

from kombu import serialization

from celery_fence.store.records import ENQUEUED_HEADER, TAKEOVER_HEADER

__all__ = ["encode_request", "execution_options", "message_publish_options", "request_text"]


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
        **message_publish_options(context),
    }
    return {name: value for name, value in kept.items() if value is not None}


def message_publish_options(context: Any) -> dict[str, Any]:
    """How the message of a Celery task request was published, as ``send_task`` takes it:
    ``serializer`` (the name kombu registered for its content type), ``compression`` (its
    ``compression`` header) and ``delivery_mode``, without the unknown ones. Celery's own
    ``Task.retry`` keeps none of them; a worker's request carries the content type in its
    ``properties`` (:class:`~celery_fence.adapters.worker.FencedRequest` adds it where the
    transport's properties lack it, as Redis' do). ``retry_policy`` is the producer's and never
    reaches the worker."""
    get = context.__dict__.get
    properties = get("properties") or {}
    serializer = serialization.registry.type_to_name.get(properties.get("content_type"))
    compression = get("compression")
    delivery_mode = properties.get("delivery_mode")
    kept = {
        "serializer": serializer,
        "compression": compression if isinstance(compression, str) else None,
        "delivery_mode": delivery_mode if isinstance(delivery_mode, int) else None,
    }
    return {name: value for name, value in kept.items() if value is not None}


def _json_headers(headers: Any) -> dict[str, Any] | None:
    out = {}
    for name, value in dict(headers or {}).items():
        if str(name).lower().startswith("x-") or name in (ENQUEUED_HEADER, TAKEOVER_HEADER):
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
