"""The log filters of celery_fence.announce.logs: attempt context on task records, payload
redaction."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task
from celery.app import trace
from celery.app.log import TaskFormatter
from celery.app.task import _task_stack
from celery.worker.consumer import consumer

from celery_fence import install
from celery_fence.announce import logs
from celery_fence.announce.logs import (
    REDACTED,
    FenceContextFilter,
    RedactCeleryPayloads,
    fenced_task_format,
    install_redaction,
    redaction_enabled,
    uninstall_redaction,
)

SECRET = "s3cret-payload"
CELERY_TASK_FORMAT = (
    "[%(asctime)s: %(levelname)s/%(processName)s] %(task_name)s[%(task_id)s]: %(message)s"
)


def _record(name: str, msg: str, *args: Any, **attrs: Any) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(attrs)
    return record


def _success_context() -> dict[str, Any]:
    return {
        "id": "tid-1",
        "name": "reports.build",
        "return_value": f"{{'report': '{SECRET}'}}",
        "runtime": 0.25,
        "args": f"('{SECRET}',)",
        "kwargs": f"{{'to': '{SECRET}'}}",
    }


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# -- redaction ------------------------------------------------------------------------------------


def test_success_line_keeps_name_and_id_but_not_the_return_value() -> None:
    context = _success_context()
    record = _record("celery.app.trace", trace.LOG_SUCCESS, context, data=context)

    assert RedactCeleryPayloads().filter(record) is True

    message = record.getMessage()
    assert SECRET not in message and SECRET not in repr(record.args)
    assert message.endswith(f": {REDACTED}")
    assert "reports.build[tid-1] succeeded in 0.25s" in message
    assert SECRET not in repr(record.data)  # type: ignore[attr-defined]
    assert context["return_value"].endswith(f"{SECRET}'}}")  # Celery's own dict is not mutated


def test_received_and_failure_contexts_lose_args_and_kwargs() -> None:
    received = {"id": "t", "name": "n", "args": SECRET, "kwargs": SECRET, "eta": None}
    failure = {**received, "exc": "ValueError('x')", "description": "raised unexpected"}
    records = [
        _record("celery.worker.strategy", trace.LOG_RECEIVED, received, data=received),
        _record("celery.app.trace", trace.LOG_FAILURE, failure, data=failure),
    ]
    for record in records:
        RedactCeleryPayloads().filter(record)
        assert SECRET not in repr(record.args) and SECRET not in repr(record.__dict__["data"])
    assert records[1].getMessage() == "Task n[t] raised unexpected: ValueError('x')"


def test_pool_line_and_message_reports_lose_their_body_positions() -> None:
    pool = _record(
        "celery.pool",
        "TaskPool: Apply %s (args:%s kwargs:%s)",
        "<function fast_trace_task>",
        f"('reports.build', 'tid', {{}}, b'[[\"{SECRET}\"], {{}}, {{}}]')",
        "{}",
    )
    unknown = _record(
        "celery.worker.consumer.consumer",
        consumer.UNKNOWN_TASK_ERROR,
        "KeyError('x')",
        SECRET,
        {"argsrepr": SECRET},
        {"routing_key": "celery"},
    )
    for record in (pool, unknown):
        RedactCeleryPayloads().filter(record)
        assert SECRET not in record.getMessage()
    assert pool.getMessage() == (
        f"TaskPool: Apply <function fast_trace_task> (args:{REDACTED} kwargs:{REDACTED})"
    )
    assert "routing_key" in unknown.getMessage()  # the delivery info stays


def test_records_of_other_loggers_and_other_templates_are_untouched() -> None:
    user = _record("myapp.reports", "report %(args)s", {"args": SECRET})
    celery_plain = _record("celery.worker.consumer.consumer", "Connected to %s", SECRET)
    for record in (user, celery_plain):
        RedactCeleryPayloads().filter(record)
        assert SECRET in record.getMessage()


@pytest.fixture
def trace_capture() -> Iterator[Capture]:
    log = logging.getLogger("celery.app.trace")
    capture, level = Capture(), log.level
    log.addHandler(capture)
    log.setLevel(logging.INFO)
    yield capture
    log.removeHandler(capture)
    log.setLevel(level)
    uninstall_redaction()


def test_installed_redaction_applies_to_any_handler_of_celery_loggers(
    trace_capture: Capture,
) -> None:
    log = logging.getLogger("celery.app.trace")
    # Given no redaction, Celery's success line carries the payload ...
    log.info(trace.LOG_SUCCESS, _success_context())
    assert SECRET in trace_capture.records[-1].getMessage()
    # ... and once installed (twice: idempotent), a handler of the user's own gets it redacted.
    install_redaction()
    install_redaction()
    assert log.filters.count(logs._redaction_filter) == 1
    log.info(trace.LOG_SUCCESS, _success_context())
    assert SECRET not in trace_capture.records[-1].getMessage()


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), (True, True), (False, False), ("true", True), ("off", False)],
)
def test_the_setting_decides_whether_redaction_is_installed(value: Any, expected: bool) -> None:
    app = Celery("t", set_as_current=False)
    if value is not None:
        app.conf.fence_redact_celery_logs = value
    assert redaction_enabled(app) is expected


def test_an_invalid_setting_redacts_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("t", set_as_current=False)
    app.conf.fence_redact_celery_logs = "maybe"
    with caplog.at_level(logging.ERROR, logger="celery_fence"):
        assert redaction_enabled(app) is True
    assert "fence_redact_celery_logs" in caplog.text


# -- attempt context ------------------------------------------------------------------------------


@pytest.fixture
def fenced_task() -> Iterator[Task]:
    """A Celery task on the current-task stack whose request carries a running attempt."""
    app = Celery("t", set_as_current=False)

    @app.task(bind=True)
    def build(self: Any) -> None:
        """A task."""

    fence = SimpleNamespace(key="report:42", generation=3, attempt_id="a" * 32)
    build.push_request(id="tid-42", fence=fence)
    _task_stack.push(build)
    yield build
    _task_stack.pop()
    build.pop_request()


def _task_line(record: logging.LogRecord) -> str:
    handler = Capture()
    handler.addFilter(FenceContextFilter())
    handler.setFormatter(TaskFormatter(fenced_task_format(CELERY_TASK_FORMAT), use_color=False))
    assert handler.filter(record)
    return handler.format(record)


def test_task_log_lines_name_the_running_attempt(fenced_task: Task) -> None:
    record = _record("myapp.tasks", "collecting %d rows", 10)
    line = _task_line(record)
    assert line.endswith(
        f"[tid-42] key=report:42 generation=3 attempt={'a' * 32}: collecting 10 rows"
    )
    assert (record.fence_key, record.generation, record.attempt_id) == (  # type: ignore[attr-defined]
        "report:42",
        3,
        "a" * 32,
    )


def test_fence_own_extras_are_not_overwritten(fenced_task: Task) -> None:
    record = _record("celery_fence", "fence stale", fence_key="report:42", generation=2)
    FenceContextFilter().filter(record)
    assert record.generation == 2  # type: ignore[attr-defined]


def test_outside_a_fenced_body_lines_are_celerys_own() -> None:
    record = _record("myapp.tasks", "idle")
    line = _task_line(record)
    assert line.endswith("???[???]: idle")
    assert not hasattr(record, "generation")


def test_only_celerys_task_id_format_is_amended_and_only_once() -> None:
    amended = fenced_task_format(CELERY_TASK_FORMAT)
    assert "[%(task_id)s]%(fence_context)s: %(message)s" in amended
    assert fenced_task_format(amended) == amended
    assert fenced_task_format("%(levelname)s %(message)s") == "%(levelname)s %(message)s"


def test_the_task_logger_signal_installs_context_and_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The current app is whichever was created last (another test's, a conftest's): this test's
    # is an installed one that does not redact, so only the context filter is expected.
    app = Celery("fenced-no-redaction", set_as_current=False)
    install(app)
    monkeypatch.setattr(logs, "_current_app", lambda: app)
    task_logger = logging.getLogger(f"test.celery_fence.tasks.{id(object())}")
    handler = logging.StreamHandler()
    handler.setFormatter(TaskFormatter(CELERY_TASK_FORMAT, use_color=False))
    task_logger.addHandler(handler)
    try:
        logs._on_setup_task_logger(logger=task_logger)
        logs._on_setup_task_logger(logger=task_logger)
        assert handler.filters == [logs._context_filter]
        assert handler.formatter is not None
        assert handler.formatter._fmt == fenced_task_format(CELERY_TASK_FORMAT)
    finally:
        task_logger.removeHandler(handler)
