"""Outcome -> store ending -> disposition, table-driven, against a fake store (the failure windows
themselves are tested with real workers in tests/acceptance)."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any

import gevent
import greenlet
import pytest
import sqlalchemy.exc as sa_exc
from celery.exceptions import Ignore, Reject, Retry

from celery_fence.config import FenceConfig
from celery_fence.errors import (
    ConfigurationError,
    JobDead,
    LeaseLost,
    PermanentError,
    ResultNotSerializable,
    RetryNotSent,
    StaleGeneration,
)
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline import settle as s
from celery_fence.pipeline.claim import Claim
from celery_fence.pipeline.execution import Execution
from celery_fence.pipeline.retry import RetryPolicy
from celery_fence.store import JobRecord
from celery_fence.store.records import Ending, Registration

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _record(status: str, result: Any = None) -> JobRecord:
    return JobRecord(
        key="k",
        task_name="t",
        status=status,
        generation=9,
        attempt_id="newer",
        attempts=1,
        result=result,
        request=None,
        error_type=None,
        error_message=None,
        created_at=NOW,
        updated_at=NOW,
        finished_at=None,
        retry_at=None,
    )


@dataclass
class FakeTransitions:
    """The transition read: ``last`` is the key's last exit."""

    last: str | None = None

    def last_exit(self, key: str) -> str | None:
        return self.last


@dataclass
class FakeStore:
    """Records the writes; ``fail`` maps a write's name (a method's, or an ending value's class
    name) to the exception it raises."""

    fail: dict[str, BaseException] = field(default_factory=dict)
    current: JobRecord | None = None
    transitions: FakeTransitions = field(default_factory=FakeTransitions)
    writes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _write(self, name: str, **kw: Any) -> None:
        if name in self.fail:
            raise self.fail[name]
        self.writes.append((name, kw))

    def end(self, key: str, ending: Ending) -> bool:
        """An ending, recorded by its value's name (``Completion``, ``Dead``, ...)."""
        self._write(
            type(ending).__name__, **{f.name: getattr(ending, f.name) for f in fields(ending)}
        )
        return True

    def register(self, key: str, **kw: Any) -> Registration:
        self._write("register", **kw)
        if self.current is None:
            return Registration("registered", 1, kw["generation"])
        status = self.current.status
        outcome = status if status in ("completed", "dead") else "stale"
        return Registration(outcome, 1, self.current.generation, self.current)  # type: ignore[arg-type]

    def record(self, key: str, **kw: Any) -> None:
        self._write("record", **kw)

    def get(self, key: str) -> JobRecord | None:
        if "get" in self.fail:
            raise self.fail["get"]
        return self.current


class NoBudget:
    def spend(self, name: str) -> float:
        return 0.0


def _attempt(store: FakeStore, **config: Any) -> Execution:
    cfg = FenceConfig(lease_ttl=2.0, renew_interval=0.5, max_attempts=3, **config)
    emitted: list[str] = []
    attempt = Execution(
        "k",
        task_name="t",
        config=cfg,
        store=store,
        leases=None,  # type: ignore[arg-type]
        renewer=None,  # type: ignore[arg-type]
        policy=RetryPolicy(cfg, budget=NoBudget()),  # type: ignore[arg-type]
        announcer=lambda action, **_: emitted.append(str(action)),  # type: ignore[arg-type]
        attempt_id="mine",
    )
    # what its claim and registration decided: generation 7, registered, its first execution
    attempt.claim = Claim("mine", generation=7, attempts=1, registered=True)
    attempt.emitted = emitted  # type: ignore[attr-defined]
    return attempt


def _settle(execution: Execution, outcome: Any) -> o.Disposition:
    """The settle step with the execution's claim as far as it got."""
    return s.settle(execution, execution.claim, outcome)


STALE = StaleGeneration("newer generation", stored_generation=9)
DOWN = sa_exc.OperationalError("UPDATE", {}, Exception("server closed the connection"))


def _data_error() -> sa_exc.DataError:
    return sa_exc.DataError("INSERT", {}, Exception("unsupported Unicode escape sequence\nLINE"))


CASES: list[tuple[str, Any, dict[str, BaseException], JobRecord | None, type, str | None]] = [
    # (name, outcome, failing store methods, stored record, action type, store write)
    ("completed", o.Completed({"ok": 1}), {}, None, o.Return, "Completion"),
    (
        "completed, stale, newer done",
        o.Completed(1),
        {"Completion": STALE},
        _record("completed", 2),
        o.Return,
        "record",
    ),
    (
        "completed, stale, newer running",
        o.Completed(1),
        {"Completion": STALE},
        _record("running"),
        o.Resend,
        "record",
    ),
    (
        "completed, not JSON",
        o.Completed(1),
        {"Completion": ResultNotSerializable("x")},
        None,
        o.Fail,
        "Dead",
    ),
    (
        "completed, refused value",
        o.Completed(1),
        {"Completion": _data_error()},
        None,
        o.Fail,
        "Dead",
    ),
    ("completed, store down", o.Completed(1), {"Completion": DOWN}, None, o.Resend, None),
    ("replayed", o.Replayed(_record("completed", 5)), {}, None, o.Return, None),
    ("already dead", o.AlreadyDead(_record("dead")), {}, None, o.Fail, None),
    ("exhausted", o.Exhausted(), {}, None, o.Fail, "Dead"),
    ("failed, transient", o.Failed(ConnectionError("x")), {}, None, o.Resend, "RetryScheduled"),
    ("failed, permanent", o.Failed(PermanentError("x")), {}, None, o.Fail, "Dead"),
    (
        "failed, store down",
        o.Failed(ConnectionError("x")),
        {"RetryScheduled": DOWN},
        None,
        o.Resend,
        None,
    ),
    (
        "failed, dead not recorded",
        o.Failed(PermanentError("x")),
        {"Dead": DOWN},
        None,
        o.Resend,
        None,
    ),
    ("lost", o.Lost(LeaseLost("x")), {}, None, o.Resend, "RetryScheduled"),
    (
        "lost, stale",
        o.Lost(LeaseLost("x")),
        {"RetryScheduled": STALE},
        _record("running"),
        o.Resend,
        "record",
    ),
    ("stale, get fails", o.Stale(STALE), {"get": DOWN}, None, o.Resend, "record"),
    ("busy", o.Busy(1.5), {}, None, o.Resend, None),
    ("group full", o.Limited("group_full", 1.0, "3 of 3"), {}, None, o.Resend, "record"),
    ("rate limited", o.Limited("rate_limited", 0.2, "1/s"), {}, None, o.Resend, "record"),
    (
        "rate limited, store down",
        o.Limited("rate_limited", 0.2, "x"),
        {"record": DOWN},
        None,
        o.Resend,
        None,
    ),
    ("unavailable", o.Unavailable(DOWN, "store unavailable"), {}, None, o.Resend, None),
    (
        "refused arguments",
        o.Refused(_data_error(), '{"args":[]}'),
        {},
        None,
        o.Fail,
        "DeadRefused",
    ),
    (
        "refused, store down",
        o.Refused(_data_error(), None),
        {"DeadRefused": DOWN},
        None,
        o.Resend,
        None,
    ),
    (
        "refused, job completed already",
        o.Refused(_data_error(), None),
        {"DeadRefused": STALE},
        _record("completed", 5),
        o.Return,
        None,
    ),
    (
        "refused, job dead already",
        o.Refused(_data_error(), None),
        {"DeadRefused": STALE},
        _record("dead"),
        o.Fail,
        None,
    ),
    (
        "refused, newer generation running",
        o.Refused(_data_error(), None),
        {"DeadRefused": STALE},
        _record("running"),
        o.Resend,
        "record",
    ),
    (
        "unkeyed",
        o.Unkeyed(ConfigurationError("bad key"), "id", None),
        {},
        None,
        o.Fail,
        "DeadUnregistered",
    ),
    ("control: retry", o.Control(Retry(when=0.5)), {}, None, o.Reraise, "RetryScheduled"),
    (
        "control: requeue",
        o.Control(Reject("x", requeue=True)),
        {},
        None,
        o.Reraise,
        "RetryScheduled",
    ),
    ("control: reject", o.Control(Reject("x", requeue=False)), {}, None, o.Reraise, "Dead"),
    (
        "control: retry not sent",
        o.Control(RetryNotSent(ConnectionError("x"))),
        {},
        None,
        o.Reraise,
        "RetryScheduled",
    ),
    ("control: ignore", o.Control(Ignore()), {}, None, o.Reraise, "Dead"),
    ("control: stale", o.Control(Ignore()), {"Dead": STALE}, None, o.Reraise, None),
    ("control: store down", o.Control(Ignore()), {"Dead": DOWN}, None, o.Resend, None),
    (
        "interrupted: cancelled",
        o.Interrupted(asyncio.CancelledError()),
        {},
        None,
        o.Resend,
        "RetryScheduled",
    ),
    ("interrupted: exit", o.Interrupted(SystemExit(1)), {}, None, o.Reraise, "RetryScheduled"),
    (
        "interrupted: Ctrl-C",
        o.Interrupted(KeyboardInterrupt()),
        {},
        None,
        o.Reraise,
        "RetryScheduled",
    ),
    (
        "interrupted: gevent time limit",
        o.Interrupted(gevent.Timeout(1.0)),
        {},
        None,
        o.Reraise,
        "RetryScheduled",
    ),
    (
        "interrupted: greenlet killed",
        o.Interrupted(greenlet.GreenletExit()),
        {},
        None,
        o.Reraise,
        "RetryScheduled",
    ),
    (
        "interrupted: cancelled, stale",
        o.Interrupted(asyncio.CancelledError()),
        {"RetryScheduled": STALE},
        _record("running"),
        o.Resend,
        "record",
    ),
    (
        "interrupted: cancelled, store down",
        o.Interrupted(asyncio.CancelledError()),
        {"RetryScheduled": DOWN},
        None,
        o.Resend,
        None,
    ),
    (
        "interrupted: exit, store down",
        o.Interrupted(SystemExit(1)),
        {"RetryScheduled": DOWN},
        None,
        o.Reraise,
        None,
    ),
    (
        "unexpected, registered",
        o.Unexpected(RuntimeError("x")),
        {},
        None,
        o.Resend,
        "RetryScheduled",
    ),
]


@pytest.mark.parametrize(
    ("outcome", "fail", "current", "action", "write"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_outcome_to_store_write_and_action(
    outcome: Any,
    fail: dict[str, BaseException],
    current: JobRecord | None,
    action: type,
    write: str | None,
) -> None:
    store = FakeStore(fail=dict(fail), current=current)
    result = _settle(_attempt(store), outcome)
    assert type(result) is action
    assert [name for name, _ in store.writes] == ([write] if write else [])


def test_exhausted_keeps_the_executions_and_names_the_time_limit() -> None:
    store = FakeStore(transitions=FakeTransitions(last="time_limit"))
    attempt = _attempt(store)
    attempt.claim = replace(attempt.claim, attempts=4)  # the fourth delivery: three were spent
    action = _settle(attempt, o.Exhausted())
    assert isinstance(action, o.Fail) and isinstance(action.error, JobDead)
    [(name, kw)] = store.writes
    assert (name, kw["attempts"], kw["reason"]) == ("Dead", 3, "time limit")


def test_a_replay_returns_the_stored_result_and_a_stale_completion_converges_on_it() -> None:
    replay = _settle(_attempt(FakeStore()), o.Replayed(_record("completed", [1])))
    assert replay == o.Return([1], deliver="k", replay=True)  # undelivered outbox rows go again
    store = FakeStore(fail={"Completion": STALE}, current=_record("completed", {"by": "newer"}))
    assert _settle(_attempt(store), o.Completed({"by": "me"})) == o.Return({"by": "newer"})


def test_a_completion_with_effects_asks_for_their_delivery() -> None:
    action = _settle(_attempt(FakeStore()), o.Completed(1, effects=("e",)))  # type: ignore[arg-type]
    assert action == o.Return(1, deliver="k")


def test_a_retry_budget_that_cannot_be_reached_still_retries() -> None:
    class Broken:
        def spend(self, name: str) -> float:
            raise RuntimeError("SlotNotCoveredError")

    store = FakeStore()
    attempt = _attempt(store)
    attempt.policy = RetryPolicy(attempt.config, budget=Broken())  # type: ignore[arg-type]
    action = _settle(attempt, o.Failed(ConnectionError("x")))
    assert isinstance(action, o.Resend) and "retry budget unavailable" in action.reason
    assert [name for name, _ in store.writes] == ["RetryScheduled"]


def test_a_refused_value_error_names_the_cause_and_the_fix_without_the_value() -> None:
    action = _settle(_attempt(FakeStore()), o.Refused(_data_error(), None))
    assert isinstance(action, o.Fail)
    message = str(action.error)
    assert "unsupported Unicode escape sequence" in message and "\\u0000" in message
    assert "LINE" not in message  # only the driver's first line: its context can quote values


def test_unregistered_unexpected_errors_resend_without_a_write() -> None:
    store = FakeStore()
    attempt = _attempt(store)
    attempt.claim = Claim("mine")  # nothing claimed
    action = _settle(attempt, o.Unexpected(RuntimeError("boom"), where="claim"))
    assert isinstance(action, o.Resend) and "claim" in action.reason
    assert store.writes == []


@pytest.mark.parametrize(
    "error", [asyncio.CancelledError(), SystemExit(0)], ids=["cancelled", "exit"]
)
def test_an_interruption_before_registration_writes_nothing_and_keeps_its_exit(
    error: BaseException,
) -> None:
    store = FakeStore()
    attempt = _attempt(store)
    attempt.claim = replace(attempt.claim, registered=False, attempts=0)
    action = _settle(attempt, o.Interrupted(error))
    assert store.writes == []
    if isinstance(error, SystemExit):
        assert action == o.Reraise(error)  # the process is exiting: Celery gives the message back
    else:
        assert isinstance(action, o.Resend) and "CancelledError" in action.reason


def test_an_exit_in_a_pool_thread_is_re_sent_not_raised() -> None:
    # Given SystemExit raised in a thread (the threads pool): nothing exits with it
    store = FakeStore()
    actions: list[o.Disposition] = []
    thread = threading.Thread(
        target=lambda: actions.append(_settle(_attempt(store), o.Interrupted(SystemExit(3))))
    )
    thread.start()
    thread.join(5)
    # Then the job is retrying and the message re-sent (the same exit on the main thread is
    # raised on: see the table)
    assert [type(action) for action in actions] == [o.Resend]
    assert [name for name, _ in store.writes] == ["RetryScheduled"]


def test_a_refused_message_of_an_ended_job_answers_from_the_stored_state() -> None:
    # completed: the stored result, as a replay; dead: the job's own dead error, acked once
    store = FakeStore(fail={"DeadRefused": STALE}, current=_record("completed", {"by": "newer"}))
    action = _settle(_attempt(store), o.Refused(_data_error(), None))
    assert action == o.Return({"by": "newer"}, deliver="k", replay=True)
    store = FakeStore(fail={"DeadRefused": STALE}, current=_record("dead"))
    action = _settle(_attempt(store), o.Refused(_data_error(), None))
    assert isinstance(action, o.Fail) and isinstance(action.error, JobDead)


def test_a_retry_the_broker_refused_is_recorded_retrying_and_given_back() -> None:
    store = FakeStore()
    refused = RetryNotSent(ConnectionError("broker down"))
    action = _settle(_attempt(store), o.Control(refused))
    assert action == o.Reraise(refused) and refused.requeue
    [(name, kw)] = store.writes
    assert name == "RetryScheduled"
    assert kw["reason"] == "the task's retry could not be sent; the message goes back"


def test_a_completion_returns_the_stored_json_value_not_the_raw_one() -> None:
    store = FakeStore()
    action = _settle(_attempt(store), o.Completed({1: "a", "t": (1, 2)}))
    assert action == o.Return({"1": "a", "t": [1, 2]})  # what a replay returns


def test_a_final_failure_is_dead_at_once_whatever_the_retry_policy() -> None:
    store = FakeStore()
    error = ValueError("the body's own error")
    action = _settle(_attempt(store), o.Failed(error, final="max_retries exceeded"))
    assert action == o.Fail(error)
    assert [name for name, _ in store.writes] == ["Dead"]
    assert store.writes[0][1]["reason"] == "max_retries exceeded"


#: What each outcome of an attempt in the caller's thread (no message behind it) ends as: the
#: ending written and the disposition (the caller gets the error; nothing is left ``retrying``).
IN_CALLER: list[tuple[str, str, Any, type, str | None]] = [
    ("failed", "direct call", o.Failed(ValueError("x")), o.Fail, "CallerFailed"),
    ("permanent", "eager run", o.Failed(PermanentError("x")), o.Fail, "CallerFailed"),
    ("lost", "direct call", o.Lost(LeaseLost("gone")), o.Fail, "CallerFailed"),
    ("unexpected", "eager run", o.Unexpected(RuntimeError("bug")), o.Fail, "CallerFailed"),
    ("direct retry", "direct call", o.Control(Retry("r", when=1)), o.Reraise, "CallerFailed"),
    ("eager retry", "eager run", o.Control(Retry("r", when=1)), o.Reraise, "RetryScheduled"),
    ("requeue", "eager run", o.Control(Reject("r", requeue=True)), o.Reraise, "CallerFailed"),
    ("ignore", "direct call", o.Control(Ignore()), o.Reraise, "CallerFailed"),
    ("busy", "direct call", o.Busy(1.5), o.Resend, None),
    ("group full", "direct call", o.Limited("group_full", 1.0, "3 of 3"), o.Resend, None),
]


@pytest.mark.parametrize(
    ("how", "outcome", "action", "write"),
    [case[1:] for case in IN_CALLER],
    ids=[case[0] for case in IN_CALLER],
)
def test_an_attempt_in_the_caller_s_thread_is_never_left_for_a_re_send(
    how: str, outcome: Any, action: type, write: str | None
) -> None:
    store = FakeStore()
    attempt = _attempt(store)
    attempt.in_caller, attempt.eager = how, how == "eager run"
    result = _settle(attempt, outcome)
    error = getattr(result, "error", None)
    assert type(result) is action
    assert [name for name, _ in store.writes] == ([write] if write else [])
    if write == "CallerFailed":
        assert store.writes[0][1]["reason"].endswith(f"in the caller's thread ({how})")
        assert error is outcome.error  # the caller gets the body's own error
    if isinstance(outcome, (o.Busy, o.Limited)):  # raised to the caller: it names the fix
        assert "a direct call is not re-sent" in str(error)


@pytest.mark.parametrize("reason", ["group_full", "rate_limited"])
def test_a_message_over_a_limit_is_re_sent_when_due_and_the_row_says_why(reason: str) -> None:
    store = FakeStore()
    attempt = _attempt(store)
    result = _settle(attempt, o.Limited(reason, 0.8, "detail"))
    assert isinstance(result, o.Resend) and result.reason == reason
    assert 0.8 <= result.countdown <= 1.0  # when due, with a little jitter
    assert store.writes == [
        ("record", {"action": "retry_scheduled", "attempt_id": "mine", "reason": reason})
    ]
    assert attempt.emitted == ["retry_scheduled"]  # type: ignore[attr-defined]


def test_a_failed_ending_a_newer_generation_fenced_out_converges_or_fails() -> None:
    # the caller's attempt was superseded: a completed job gives the caller its stored result
    store = FakeStore(fail={"CallerFailed": STALE}, current=_record("completed", result=5))
    attempt = _attempt(store)
    attempt.in_caller = "direct call"
    result = _settle(attempt, o.Failed(ValueError("x")))
    assert isinstance(result, o.Return) and result.result == 5
    # still running elsewhere: the caller gets its own error, not a re-send
    store = FakeStore(fail={"CallerFailed": STALE}, current=_record("running"))
    attempt = _attempt(store)
    attempt.in_caller = "direct call"
    error = ValueError("x")
    result = _settle(attempt, o.Failed(error))
    assert isinstance(result, o.Fail) and result.error is error
