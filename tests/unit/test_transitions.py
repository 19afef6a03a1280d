"""The transitions table and emit_transition: one vocabulary, one table, one way to announce."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.utils.dispatch import Signal

from celery_fence import signals
from celery_fence.actions import Action
from celery_fence.announce import transitions
from celery_fence.announce.transitions import TABLE, Announcer, emit_transition

README = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
ROW = re.compile(r"^\| `(\w+)` \| (.+?) \| (\w+) \| `([\w.]+)` \| (.+?) \| (yes|no) \|$")


class FakeTask:
    """What emit_transition reads of a task: its name (for receivers) and its fence settings."""

    name = "tests.fake"

    def __init__(self, *, send_events: bool = True) -> None:
        self._config = type("Config", (), {"send_events": send_events})()

    def fence_config(self) -> Any:
        return self._config


@pytest.fixture
def received() -> Iterator[list[tuple[str, Any, dict[str, Any]]]]:
    """Every fence signal sent during the test: (signal name, sender, keyword arguments)."""
    seen: list[tuple[str, Any, dict[str, Any]]] = []

    def receiver(signal: Signal | None = None, sender: Any = None, **kwargs: Any) -> None:
        seen.append((signal.name if signal is not None else "?", sender, kwargs))

    all_signals = {spec.signal for spec in TABLE.values() if spec.signal is not None}
    for signal in all_signals:
        signal.connect(receiver, weak=False)
    yield seen
    for signal in all_signals:
        signal.disconnect(receiver)


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """The Celery events emit_transition queued (event type, fields), instead of sending them."""
    events: list[tuple[str, dict[str, Any]]] = []

    def fake_send(task: Any, type_: str, **fields: Any) -> None:
        events.append((type_, fields))

    monkeypatch.setattr(transitions, "send_transition_event", fake_send)
    return events


def _readme_table() -> dict[str, tuple[str | None, str, str, str | None, bool]]:
    rows = {}
    for line in README.read_text().splitlines():
        match = ROW.match(line)
        if match:
            action, signal, level, logger, event, recorded = match.groups()
            rows[action] = (
                None if signal == "—" else signal.strip("`"),
                level,
                logger,
                None if event == "—" else event.strip("`"),
                recorded == "yes",
            )
    return rows


def test_every_action_has_one_row_in_the_table() -> None:
    assert set(TABLE) == set(Action)


def test_the_documented_table_is_the_code_table() -> None:
    # Given the operating guide's table of transitions and the code's
    code = {
        action.value: (
            None if spec.signal is None else spec.signal.name,
            logging.getLevelName(spec.level),
            spec.logger.name,
            spec.event,
            spec.recorded,
        )
        for action, spec in TABLE.items()
    }
    # Then they say the same, row for row, and the guide's list of table rows is the code's
    assert _readme_table() == code
    recorded = {a.value for a in Action if TABLE[a].recorded}
    readme = README.read_text()
    rows_bullet = readme[readme.index("- **a row in the transitions table**") :]
    rows_bullet = rows_bullet[: rows_bullet.index("change nothing")]
    listed = set(re.findall(r"`(\w+)`", rows_bullet)) - {"fence_record_transitions"}
    unrecorded = {"renewed", "busy", "replayed", "taken_over"}
    assert listed - unrecorded == recorded
    assert unrecorded == {a.value for a in Action} - recorded


def test_public_names_are_kept() -> None:
    # The retry's one word is retry_scheduled; its signal and Flower event are named otherwise.
    spec = TABLE[Action.RETRY_SCHEDULED]
    assert spec.signal is signals.job_retry_scheduled
    assert spec.event == "task-fenceretry"
    assert {a.value for a in Action if TABLE[a].event} == {
        "claimed",
        "renewed",
        "lost",
        "busy",
        "completed",
        "replayed",
        "stale",
        "retry_scheduled",
        "dead",
    }


def test_emit_logs_signals_and_queues_the_event(
    caplog: pytest.LogCaptureFixture,
    received: list[tuple[str, Any, dict[str, Any]]],
    queued: list[tuple[str, dict[str, Any]]],
) -> None:
    task = FakeTask()
    # When a worker's attempt schedules a retry
    with caplog.at_level(logging.DEBUG, logger="celery_fence"):
        emit_transition(
            Action.RETRY_SCHEDULED,
            task,
            key="k",
            attempt_id="a1",
            generation=3,
            reason="transient error",
            origin=("task-id", "worker@host"),
            countdown=1.5,
            attempts=2,
        )
    # Then one log line says retry_scheduled, with the stable extra keys and no payload
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.name == "celery_fence"
    assert record.getMessage() == (
        "fence retry_scheduled key=k generation=3 attempt=a1 reason=transient error"
    )
    assert (record.action, record.fence_key, record.attempt_id, record.generation) == (  # type: ignore[attr-defined]
        "retry_scheduled",
        "k",
        "a1",
        3,
    )
    assert type(record.action) is str  # type: ignore[attr-defined]
    # And the public signal is sent by the task with the transition's fields
    assert received == [
        (
            "job_retry_scheduled",
            task,
            {
                "key": "k",
                "attempt_id": "a1",
                "generation": 3,
                "reason": "transient error",
                "countdown": 1.5,
                "attempts": 2,
            },
        )
    ]
    # And the Flower event keeps its name
    assert queued == [
        (
            "task-fenceretry",
            {
                "task_id": "task-id",
                "hostname": "worker@host",
                "fence_key": "k",
                "attempt_id": "a1",
                "generation": 3,
                "reason": "transient error",
                "countdown": 1.5,
                "attempts": 2,
            },
        )
    ]


def test_renewals_log_on_the_renewer_logger_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_fence"):
        emit_transition(Action.RENEWED, FakeTask(), key="k", attempt_id="a", generation=1)
    (record,) = caplog.records
    assert (record.name, record.levelno, record.action) == (  # type: ignore[attr-defined]
        "celery_fence.renewer",
        logging.DEBUG,
        "renewed",
    )


def test_no_event_without_a_worker_origin_or_with_events_off(
    queued: list[tuple[str, dict[str, Any]]],
) -> None:
    emit_transition(Action.COMPLETED, FakeTask(), key="k", generation=1)
    quiet = Announcer(FakeTask(send_events=False), ("t", "h"), events=False)
    quiet(Action.COMPLETED, key="k", generation=1)
    emit_transition(Action.REQUEUED, FakeTask(), key="k", origin=("t", "h"), countdown=0.0)
    assert queued == []
    # (the same announcer with events on does send one: the check above can fail)
    Announcer(FakeTask(), ("t", "h"), events=True)(Action.COMPLETED, key="k", generation=1)
    assert [name for name, _ in queued] == ["task-fencecompleted"]


def test_operator_transitions_log_and_signal_without_an_event(
    caplog: pytest.LogCaptureFixture,
    received: list[tuple[str, Any, dict[str, Any]]],
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_fence"):
        emit_transition(Action.RECOVERED, "tests.fake", key="k", reason="stranded running")
        emit_transition(Action.TIME_LIMIT, FakeTask(), key="k", reason="hard time limit 1s")
    assert [(r.name, r.action) for r in caplog.records] == [  # type: ignore[attr-defined]
        ("celery_fence.recovery", "recovered"),
        ("celery_fence", "time_limit"),
    ]
    assert [(name, sender) for name, sender, _ in received] == [
        ("job_retry_scheduled", "tests.fake")
    ]


def test_a_raising_receiver_or_event_never_breaks_the_caller(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(**_: Any) -> None:
        raise RuntimeError("receiver failed on purpose")

    def broken_send(*_: Any, **__: Any) -> None:
        raise RuntimeError("broker down")

    monkeypatch.setattr(transitions, "send_transition_event", broken_send)
    signals.job_dead.connect(broken, weak=False)
    try:
        with caplog.at_level(logging.ERROR, logger="celery_fence"):
            emit_transition(Action.DEAD, FakeTask(), key="k", origin=("t", "h"), attempts=1)
    finally:
        signals.job_dead.disconnect(broken)
    assert any(r.action == "dead" for r in caplog.records if hasattr(r, "action"))


def test_a_disabled_level_formats_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # Given the renewer's logger at INFO, a renewal (DEBUG) is not logged at all
    with caplog.at_level(logging.INFO, logger="celery_fence.renewer"):
        emit_transition(Action.RENEWED, FakeTask(), key="k", generation=1)
    assert caplog.records == []


def test_a_retry_logs_the_errors_first_line_and_its_traceback_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a body error with a multi-line message (a driver's context lines can quote values)
    try:
        raise RuntimeError("lock not available\nDETAIL: row (secret-value) is locked")
    except RuntimeError as exc:
        error = exc
    # When its retry is announced with the logger at DEBUG
    with caplog.at_level(logging.DEBUG, logger="celery_fence"):
        transitions.emit_transition(
            Action.RETRY_SCHEDULED, "proj.task", key="k:1", generation=3, reason="r", error=error
        )
    # Then the line names the type and first line only, and the traceback follows at DEBUG
    line = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert line.getMessage().endswith("error=RuntimeError: lock not available")
    assert "secret-value" not in line.getMessage()
    assert getattr(line, "error", None) == "RuntimeError: lock not available"
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(debug) == 1 and debug[0].exc_info is not None and debug[0].exc_info[1] is error


def test_error_line_is_bounded_and_uses_the_drivers_first_line() -> None:
    import sqlalchemy as sa

    orig = ValueError("invalid input syntax\nLINE 1: ... 'payload' ...")
    wrapped = sa.exc.DataError("INSERT ... (%(a)s)", {"a": "payload"}, orig)
    assert transitions.error_line(wrapped) == "DataError: invalid input syntax"
    long = transitions.error_line(RuntimeError("x" * 1000))
    assert len(long) == transitions.ERROR_LINE_LENGTH and long.endswith("…")
