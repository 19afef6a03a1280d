"""The request a job keeps for a re-send: what Celery needs to carry its workflow on, JSON only."""

from __future__ import annotations

import json
from typing import Any

from celery.app.task import Context

from celery_fence.adapters.request import request_text


def _context(**fields: Any) -> Context:
    return Context({"id": "t-1", "delivery_info": {"exchange": "", "routing_key": "q"}, **fields})


def test_the_workflow_and_time_limits_are_kept_and_unset_options_left_out() -> None:
    step: dict[str, Any] = {"task": "next", "args": [], "kwargs": {}, "options": {}}
    context = _context(
        chain=[step],
        callbacks=[step],
        errbacks=[step],
        group="g",
        group_index=0,
        root_id="r",
        parent_id="p",
        timelimit=(30, 20),
        tenant="t1",  # a custom header
        **{"x-death": [{"count": 1}]},  # the broker's own
    )
    text = request_text("task", [1], {"a": 2}, context)
    assert text is not None
    stored = json.loads(text)
    assert (stored["task"], stored["id"], stored["args"], stored["kwargs"]) == (
        "task",
        "t-1",
        [1],
        {"a": 2},
    )
    assert stored["execution"] == {
        "chain": [step],
        "link": [step],
        "link_error": [step],
        "group_id": "g",
        "group_index": 0,
        "root_id": "r",
        "parent_id": "p",
        "time_limit": 30,
        "soft_time_limit": 20,
        "headers": {"tenant": "t1"},
    }
    bare = json.loads(request_text("task", [], {}, _context()) or "null")
    assert "execution" not in bare


def test_a_workflow_that_is_not_json_is_not_stored_half() -> None:
    # A pickled message's chain may hold any object: storing the request without its workflow
    # would make a re-send drop the rest of the chain, so nothing is stored.
    context = _context(chain=[{"task": "next", "args": [object()], "kwargs": {}}])
    assert request_text("task", [1], {}, context) is None
    # a custom header that is not JSON is left out; the request is still stored
    text = request_text("task", [1], {}, _context(trace=object()))
    assert text is not None and "headers" not in json.loads(text).get("execution", {})


def test_the_message_is_stored_as_it_was_published() -> None:
    # A worker's request: the content type in its properties (FencedRequest adds it where the
    # transport's lack it), compression as kombu's header, ignore_result as Celery's header.
    context = _context(
        properties={"content_type": "application/x-python-serialize", "delivery_mode": 1},
        compression="application/x-gzip",
        ignore_result=True,
    )
    text = request_text("task", [1], {}, context)
    assert text is not None
    assert json.loads(text)["execution"] == {
        "serializer": "pickle",
        "compression": "application/x-gzip",
        "delivery_mode": 1,
        "ignore_result": True,
    }
    # a content type kombu does not know is left out (the re-send uses the task's serializer)
    unknown = _context(properties={"content_type": "application/x-unknown"})
    assert "execution" not in json.loads(request_text("task", [], {}, unknown) or "null")
