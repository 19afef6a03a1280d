"""Flower's view of a fenced task id (``celery_fence.contrib.flower``), fed Celery events the way
Flower's event state receives them, in every order the two attempts' events can arrive."""

from __future__ import annotations

import itertools
from typing import Any

from celery.events.state import State

from celery_fence.contrib.flower import FENCE_FIELDS, FencedTaskView

TASK_ID = "3f1c"


def _event(type_: str, hostname: str, clock: int, **fields: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "uuid": TASK_ID,
        "hostname": hostname,
        "timestamp": 1000.0 + clock,
        "clock": clock,
        "local_received": 1000.0 + clock,
        **fields,
    }


def _fence(subject: str, hostname: str, clock: int, gen: int, attempt: str, **kw: Any) -> Any:
    fields = {"fence_key": "report:42", "generation": gen, "attempt_id": attempt, **kw}
    return _event(f"task-fence{subject}", hostname, clock, **fields)


STALE_WORKER = [  # generation 1 on w1: claimed, paused, resumed, rejected, converged (SUCCESS)
    _fence("claimed", "w1@h", 2, 1, "a-one"),
    _fence("lost", "w1@h", 10, 1, "a-one", reason="lease expired"),
    _fence("stale", "w1@h", 11, 1, "a-one", reason="stored generation 2"),
    _event("task-succeeded", "w1@h", 12, result="{'total': 12}", runtime=9.0),
]
COUNTED_WORKER = [  # generation 2 on w2, same task id (the re-send)
    _fence("claimed", "w2@h", 5, 2, "a-two"),
    _fence("completed", "w2@h", 6, 2, "a-two"),
    _event("task-succeeded", "w2@h", 7, result="{'total': 12}", runtime=1.0),
]


def _shown(events: list[dict[str, Any]]) -> dict[str, Any]:
    state = State()
    state.Task = FencedTaskView
    state.event(_event("task-received", "w1@h", 1, name="proj.report", args="()", kwargs="{}"))
    for event in events:
        state.event(dict(event))
    return dict(state.tasks[TASK_ID].as_dict())


def test_the_counted_attempt_and_the_stale_one_whatever_the_arrival_order() -> None:
    # Given the events of both attempts of one task id, merged in every order that keeps each
    # worker's own events in order,
    seen = set()
    for picks in set(itertools.permutations([0] * len(STALE_WORKER) + [1] * len(COUNTED_WORKER))):
        streams = [iter(STALE_WORKER), iter(COUNTED_WORKER)]
        shown = _shown([next(streams[p]) for p in picks])
        # then Celery's state stays SUCCESS, and the fence fields always name the same facts:
        assert shown["state"] == "SUCCESS"
        assert shown["fence_key"] == "report:42"
        assert shown["fence_generation"] == 2
        assert shown["fence_counted"] == "generation 2, attempt a-two on w2@h"
        assert shown["fence_stale"] == "generation 1, attempt a-one on w1@h: stored generation 2"
        assert shown["fence_attempts"] == (
            "generation 1, attempt a-one on w1@h: stale (stored generation 2); "
            "generation 2, attempt a-two on w2@h: completed (counted)"
        )
        seen.add(shown["worker"].hostname)
    # (Celery's own "worker" is the host of the latest event: either, by arrival order; which is
    # why fence_counted names the worker of the attempt that counted)
    assert seen == {"w1@h", "w2@h"}


def test_a_running_task_shows_its_key_and_generation_and_no_verdict() -> None:
    shown = _shown(
        [_fence("claimed", "w1@h", 2, 1, "a-one"), _fence("renewed", "w1@h", 3, 1, "a-one")]
    )
    assert (shown["fence_key"], shown["fence_generation"]) == ("report:42", 1)
    assert shown["fence_counted"] is None and shown["fence_stale"] is None
    assert shown["fence_attempts"] == "generation 1, attempt a-one on w1@h: running"
    assert set(FENCE_FIELDS) <= set(shown)


def test_a_plain_task_has_no_fence_fields() -> None:
    shown = _shown([_event("task-succeeded", "w1@h", 2, result="1", runtime=0.1)])
    assert all(shown[name] is None for name in FENCE_FIELDS)
