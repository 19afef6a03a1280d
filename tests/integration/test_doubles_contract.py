"""The in-memory doubles (:mod:`tests.support.memory`) against the real backends: each test
runs on the real :class:`Store` (SQLite and PostgreSQL) and on :class:`MemoryStore`, or on the
real :class:`LeaseStore` (Redis) and on :class:`MemoryLeaseStore`, and asserts the same observable
state. A double that passes here can stand in for the real one in a unit test of the pipeline.

The lease doubles run on a fake clock, advanced where the real ones sleep (a few short TTLs)."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import pytest
import redis

from celery_fence.actions import INTERRUPTED_BY, Action
from celery_fence.errors import LeaseBusy, ResultNotSerializable, StaleGeneration
from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.store.records import (
    FENCED_ENDINGS,
    CallerFailed,
    Completion,
    Dead,
    DeadRefused,
    DeadStranded,
    DeadUnregistered,
    DeadUnrun,
    Effect,
    Ending,
    JobRecord,
    RetryScheduled,
)
from tests.support.memory import MemoryLeaseStore, MemoryStore
from tests.support.stores import store_url

if TYPE_CHECKING:
    from celery_fence.leases.ports import LeaseBackend
    from celery_fence.pipeline.ports import JobStore

    def _the_real_ones_and_the_doubles_satisfy_the_ports(
        store: Store, leases: LeaseStore, memory: MemoryStore, memory_leases: MemoryLeaseStore
    ) -> None:
        """Checked by mypy, never run: each class is assignable to its protocol."""
        real_store: JobStore = store
        real_leases: LeaseBackend = leases
        store_double: JobStore = memory
        lease_double: LeaseBackend = memory_leases
        del real_store, real_leases, store_double, lease_double


# -- the store side -------------------------------------------------------------------------------


@dataclass
class Jobs:
    """One store under test, and what reads differ between the real one and the double."""

    store: Store | MemoryStore
    kind: str

    def pending(self, key: str, request: dict[str, Any]) -> None:
        """An enqueued job's ``pending`` row (generation 0, never claimed)."""
        if isinstance(self.store, MemoryStore):
            written, _ = self.store.insert_pending(key, task_name="t", request=request)
        else:
            with self.store.engine.begin() as conn:
                written, _ = self.store.pending.insert(conn, key, task_name="t", request=request)
        assert written

    def effects(self, key: str) -> list[tuple[str, str, Any]]:
        """The staged effects (outbox rows) of ``key``: (name, idempotency key, payload)."""
        if isinstance(self.store, MemoryStore):
            staged = self.store.effects(key)
            return [(e.name, e.idempotency_key, e.payload) for e in staged]
        return [
            (r.name, r.idempotency_key, r.payload) for r in self.store.outbox_rows.rows(key=key)
        ]

    def row(self, key: str) -> JobRecord:
        record = self.store.get(key)
        assert record is not None, f"no row for {key!r}"
        return record

    def actions(self, key: str) -> list[tuple[str, int | None, str | None, str | None]]:
        """The key's history: (action, generation, attempt, reason), oldest first."""
        return [
            (t.action, t.generation, t.attempt_id, t.reason)
            for t in self.store.transitions.history(key)
        ]


@pytest.fixture(params=["sqlite", "postgresql", "memory"])
def make_jobs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Jobs]]:
    """``make_jobs(**store options)``: a real store (SQLite file of this test's own, or the
    session's PostgreSQL database) or the in-memory double, with those options."""
    made: list[Store] = []
    url = None if request.param == "memory" else store_url(request, tmp_path)

    def make(**options: Any) -> Jobs:
        if url is None:
            return Jobs(MemoryStore(**options), "memory")
        store = Store(url, **options)
        made.append(store)
        return Jobs(store, request.param)

    yield make
    for store in made:
        store.dispose()


@pytest.fixture
def jobs(make_jobs: Callable[..., Jobs]) -> Jobs:
    return make_jobs()


@pytest.fixture
def key() -> str:
    """A key of this test's own (the PostgreSQL database is shared by the session)."""
    return f"contract:{uuid.uuid4().hex}"


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    """A timestamp as UTC (SQLite reads them back naive)."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc)


def _state(record: JobRecord) -> tuple[str, int, str, int]:
    return record.status, record.generation, record.attempt_id, record.attempts


# -- registration -----------------------------------------------------------------------------


def test_a_first_registration_takes_the_row(jobs: Jobs, key: str) -> None:
    reg = jobs.store.register(
        key, generation=1, attempt_id="A", task_name="t", request={"id": "m1", "args": [1]}
    )
    assert (reg.outcome, reg.attempts, reg.stored_generation, reg.record) == (
        "registered",
        1,
        1,
        None,
    )
    row = jobs.row(key)
    assert _state(row) == ("running", 1, "A", 1)
    assert (row.task_name, row.request, row.result, row.finished_at) == (
        "t",
        {"id": "m1", "args": [1]},
        None,
        None,
    )
    assert jobs.actions(key) == [("claimed", 1, "A", None)]


def test_a_greater_generation_takes_the_row_and_counts_an_attempt(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t", request={"id": "m1"})
    reg = jobs.store.register(
        key, generation=3, attempt_id="B", task_name="other", request_json='{"id":"m2"}'
    )
    assert (reg.outcome, reg.attempts, reg.stored_generation) == ("registered", 2, 3)
    row = jobs.row(key)
    assert _state(row) == ("running", 3, "B", 2)
    # the first registration's task name and request stay
    assert (row.task_name, row.request) == ("t", {"id": "m1"})


def test_a_registration_says_when_the_running_row_it_took_over_last_moved(
    jobs: Jobs, key: str
) -> None:
    first = jobs.store.register(key, generation=1, attempt_id="A", task_name="t", took_over=True)
    assert first.took_over_from is None  # a new row: nothing taken over
    moved = _utc(jobs.row(key).updated_at)
    # A newer generation of another attempt takes over the row A left running: when it moved
    reg = jobs.store.register(key, generation=2, attempt_id="B", task_name="t", took_over=True)
    assert reg.outcome == "registered" and _utc(reg.took_over_from) == moved
    # a row that was not left running (a retry scheduled) is no takeover
    retry = RetryScheduled(2, "B", None, retry_at=dt.datetime.now(dt.timezone.utc), reason="r")
    assert jobs.store.end(key, retry)
    reg = jobs.store.register(key, generation=3, attempt_id="C", task_name="t", took_over=True)
    assert reg.outcome == "registered" and reg.took_over_from is None
    # nor is a stale registration
    stale = jobs.store.register(key, generation=3, attempt_id="D", task_name="t", took_over=True)
    assert stale.outcome == "stale" and stale.took_over_from is None


@pytest.mark.parametrize("generation", [1, 2])
def test_an_equal_or_lower_generation_is_stale_and_changes_nothing(
    jobs: Jobs, key: str, generation: int
) -> None:
    jobs.store.register(key, generation=2, attempt_id="A", task_name="t")
    reg = jobs.store.register(key, generation=generation, attempt_id="B", task_name="t")
    assert (reg.outcome, reg.attempts, reg.stored_generation) == ("stale", 1, 2)
    assert reg.record is not None and _state(reg.record) == ("running", 2, "A", 1)
    assert _state(jobs.row(key)) == ("running", 2, "A", 1)
    assert [a for a, *_ in jobs.actions(key)] == ["claimed"]


def test_a_completed_job_is_never_registered_again(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.end(key, Completion(generation=1, attempt_id="A", result={"v": 1}))
    reg = jobs.store.register(key, generation=9, attempt_id="B", task_name="t")
    assert (reg.outcome, reg.attempts, reg.stored_generation) == ("completed", 1, 1)
    assert reg.record is not None and reg.record.result == {"v": 1}
    assert _state(jobs.row(key)) == ("completed", 1, "A", 1)


def test_a_dead_job_is_never_registered_again(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.end(key, Dead(generation=1, attempt_id="A", error=None, reason="budget"))
    reg = jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    assert (reg.outcome, reg.attempts, reg.stored_generation) == ("dead", 1, 1)
    assert reg.record is not None and reg.record.status == "dead"


# -- completion -------------------------------------------------------------------------------


def test_the_owner_completes_with_its_result_and_effects(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    effect = Effect("mail", {"to": "x"}, f"{key}:mail")
    jobs.store.end(
        key, Completion(generation=1, attempt_id="A", result=[1, "two"], effects=[effect])
    )
    row = jobs.row(key)
    assert _state(row) == ("completed", 1, "A", 1)
    assert row.result == [1, "two"] and row.finished_at is not None
    assert jobs.effects(key) == [("mail", f"{key}:mail", {"to": "x"})]
    assert [a for a, *_ in jobs.actions(key)] == ["claimed", "completed"]


def test_a_stale_completion_is_refused_with_the_stored_state(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    with pytest.raises(StaleGeneration) as stale:
        jobs.store.end(
            key,
            Completion(
                generation=1,
                attempt_id="A",
                result={"by": "A"},
                effects=[Effect("mail", {}, f"{key}:a")],
            ),
        )
    assert stale.value.context == {
        "key": key,
        "generation": 1,
        "attempt_id": "A",
        "stored_generation": 2,
        "stored_status": "running",
    }
    assert "completion" in str(stale.value) and "stored generation 2" in str(stale.value)
    row = jobs.row(key)
    assert (_state(row), row.result) == (("running", 2, "B", 2), None)
    assert jobs.effects(key) == []
    assert [a for a, *_ in jobs.actions(key)] == ["claimed", "claimed"]


def test_the_same_generation_from_another_attempt_is_refused(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    with pytest.raises(StaleGeneration) as stale:
        jobs.store.end(key, Completion(generation=1, attempt_id="X", result=1))
    assert stale.value.context["stored_generation"] == 1
    assert jobs.row(key).status == "running"


def test_a_completed_result_is_never_overwritten(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.end(key, Completion(generation=1, attempt_id="A", result={"v": 1}))
    with pytest.raises(StaleGeneration) as stale:
        jobs.store.end(key, Completion(generation=1, attempt_id="A", result={"v": 2}))
    assert stale.value.context["stored_status"] == "completed"
    assert jobs.row(key).result == {"v": 1}


def test_a_completion_without_a_row_is_refused(jobs: Jobs, key: str) -> None:
    with pytest.raises(StaleGeneration) as stale:
        jobs.store.end(key, Completion(generation=1, attempt_id="A", result=None))
    assert stale.value.context["stored_generation"] is None
    assert stale.value.context["stored_status"] is None
    assert "no job row" in str(stale.value)
    assert jobs.store.get(key) is None


def test_a_result_that_is_not_json_is_refused_before_any_write(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    with pytest.raises(ResultNotSerializable):
        jobs.store.end(
            key, Completion(generation=1, attempt_id="A", result={"at": dt.date.today()})
        )
    assert jobs.row(key).status == "running"


# -- retry, dead ------------------------------------------------------------------------------


def test_a_retry_is_scheduled_and_the_next_generation_takes_over(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    at = dt.datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=dt.timezone.utc)
    jobs.store.end(
        key,
        RetryScheduled(
            generation=1, attempt_id="A", error=ValueError("boom"), retry_at=at, reason="r1"
        ),
    )
    row = jobs.row(key)
    assert _state(row) == ("retrying", 1, "A", 1)
    assert _utc(row.retry_at) == at
    assert (row.error_type, row.error_message) == ("builtins.ValueError", "boom")
    reg = jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    assert (reg.outcome, reg.attempts) == ("registered", 2)
    row = jobs.row(key)
    assert (_state(row), row.retry_at) == (("running", 2, "B", 2), None)
    assert row.error_type == "builtins.ValueError"  # kept until the job completes
    assert jobs.actions(key)[1] == ("retry_scheduled", 1, "A", "r1")


def test_a_stale_retry_or_dead_letter_is_refused(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    now = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(StaleGeneration) as retry:
        jobs.store.end(
            key, RetryScheduled(generation=1, attempt_id="A", error=None, retry_at=now, reason="r")
        )
    with pytest.raises(StaleGeneration) as dead:
        jobs.store.end(key, Dead(generation=1, attempt_id="A", error=None, reason="d"))
    assert "retry for" in str(retry.value) and "dead-letter for" in str(dead.value)
    assert dead.value.context["stored_generation"] == 2
    assert _state(jobs.row(key)) == ("running", 2, "B", 2)


def test_dead_is_terminal_with_the_attempts_kept(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    jobs.store.end(
        key, Dead(generation=2, attempt_id="B", error=KeyError("k"), reason="spent", attempts=1)
    )
    row = jobs.row(key)
    assert _state(row) == ("dead", 2, "B", 1)
    assert row.finished_at is not None and row.retry_at is None
    assert (row.error_type, row.error_message) == ("builtins.KeyError", "'k'")
    assert jobs.actions(key)[-1] == ("dead", 2, "B", "spent")
    with pytest.raises(StaleGeneration):
        jobs.store.end(key, Completion(generation=2, attempt_id="B", result=1))


def test_the_error_message_is_cut_to_its_length(make_jobs: Callable[..., Jobs], key: str) -> None:
    jobs = make_jobs(error_message_length=10)
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.end(key, Dead(generation=1, attempt_id="A", error=RuntimeError("x" * 50), reason=""))
    assert jobs.row(key).error_message == "x" * 9 + "…"
    assert jobs.actions(key)[-1] == ("dead", 1, "A", None)  # an empty reason is kept as NULL


# -- endings of messages that never ran: DeadUnregistered, DeadRefused, DeadUnrun ----------


def test_dead_unregistered_inserts_dead_and_only_overwrites_pending(jobs: Jobs, key: str) -> None:
    err = ValueError("bad key")
    assert jobs.store.end(
        key, DeadUnregistered(task_name="t", request={"id": "m"}, error=err, reason="fence_key")
    )
    row = jobs.row(key)
    assert _state(row) == ("dead", 0, "-", 0) and row.request == {"id": "m"}
    assert not jobs.store.end(
        key, DeadUnregistered(task_name="t", request=None, error=err, reason="again")
    )
    other = f"{key}:p"
    jobs.pending(other, {"id": "p"})
    assert jobs.store.end(
        other, DeadUnregistered(task_name="t", request=None, error=err, reason="resent")
    )
    assert _state(jobs.row(other)) == ("dead", 0, "-", 0)
    assert jobs.row(other).request == {"id": "p"}
    assert jobs.actions(key) == [("dead", 0, "-", "fence_key")]


def test_dead_refused_is_fenced_like_a_registration(jobs: Jobs, key: str) -> None:
    err = ValueError("refused")
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.end(
        key,
        DeadRefused(
            generation=2,
            attempt_id="B",
            task_name="t2",
            request_json='{"id":"m2"}',
            error=err,
            reason="refused",
        ),
    )
    row = jobs.row(key)
    assert _state(row) == ("dead", 2, "B", 2)
    assert (row.task_name, row.request) == ("t2", {"id": "m2"})  # kept encoded, read back decoded
    with pytest.raises(StaleGeneration) as stale:
        jobs.store.end(
            key,
            DeadRefused(
                generation=3,
                attempt_id="C",
                task_name="t",
                request_json=None,
                error=err,
                reason="refused",
            ),
        )
    assert stale.value.context["stored_status"] == "dead"


def test_dead_unrun_without_a_row_records_the_job_dead(jobs: Jobs, key: str) -> None:
    jobs.store.end(key, DeadUnrun(task_name="t", request={"id": "m"}, reason="expired"))
    row = jobs.row(key)
    assert _state(row) == ("dead", 0, "-", 0) and row.request == {"id": "m"}
    assert row.error_type == "celery_fence.errors.JobDead"
    assert jobs.actions(key) == [("dead", 0, "-", "expired")]


def test_dead_unrun_kills_a_waiting_row_and_leaves_a_running_one(jobs: Jobs, key: str) -> None:
    waiting, running = f"{key}:w", f"{key}:r"
    for k in (waiting, running):
        jobs.store.register(k, generation=1, attempt_id="A", task_name="t", request={"id": "m"})
    jobs.store.end(
        waiting,
        RetryScheduled(
            generation=1,
            attempt_id="A",
            error=None,
            retry_at=dt.datetime.now(dt.timezone.utc),
            reason="r",
        ),
    )
    for k in (waiting, running):
        jobs.store.end(k, DeadUnrun(task_name="t", request={"id": "m"}, reason="revoked"))
    row = jobs.row(waiting)
    assert (_state(row), row.retry_at) == (("dead", 1, "A", 1), None)
    assert jobs.actions(waiting)[-1] == ("dead", 1, "A", "revoked")
    assert _state(jobs.row(running)) == ("running", 1, "A", 1)
    assert jobs.actions(running)[-1] == ("revoked", None, None, "message not run")


def test_dead_unrun_of_a_terminated_attempt_matches_its_message(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t", request={"id": "m1"})
    jobs.store.end(
        key, DeadUnrun(task_name="t", request=None, reason="revoked", terminated_id="m9")
    )
    assert jobs.row(key).status == "running"
    assert jobs.actions(key)[-1][3] == "attempt terminated, job left as is"
    jobs.store.end(
        key, DeadUnrun(task_name="t", request=None, reason="revoked", terminated_id="m1")
    )
    row = jobs.row(key)
    assert _state(row) == ("dead", 1, "A", 1)
    assert row.error_message is not None and "while it ran" in row.error_message


def test_dead_unrun_only_insert_spares_another_messages_job(jobs: Jobs, key: str) -> None:
    jobs.pending(key, {"id": "m1"})
    for message_id in (None, "m2"):
        jobs.store.end(
            key,
            DeadUnrun(
                task_name="t",
                request=None,
                reason="expired",
                only_insert=True,
                message_id=message_id,
            ),
        )
        assert jobs.row(key).status == "pending"
    jobs.store.end(
        key,
        DeadUnrun(
            task_name="t",
            request=None,
            reason="expired",
            only_insert=True,
            message_id="m1",
        ),
    )
    assert _state(jobs.row(key)) == ("dead", 0, "-", 0)


def test_dead_stranded_is_a_compare_and_set_on_the_row_as_read(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    read = jobs.row(key)
    err = ValueError("no request")
    with pytest.raises(ValueError, match="stranded job's record"):
        jobs.store.end(f"{key}:other", DeadStranded(read, error=err, reason="stranded"))
    assert jobs.store.end(key, DeadStranded(read, error=err, reason="stranded"))
    row = jobs.row(key)
    assert (_state(row), row.retry_at) == (("dead", 1, "A", 1), None)
    assert (row.error_type, row.error_message) == ("builtins.ValueError", "no request")
    assert row.finished_at is not None
    assert jobs.actions(key)[-1] == ("dead", 1, "A", "stranded")
    # a row that moved since it was read (here: registered again) is left as it is
    moved = f"{key}:moved"
    jobs.store.register(moved, generation=1, attempt_id="A", task_name="t")
    before = jobs.row(moved)
    jobs.store.register(moved, generation=2, attempt_id="B", task_name="t")
    assert not jobs.store.end(moved, DeadStranded(before, error=err, reason="stranded"))
    assert _state(jobs.row(moved)) == ("running", 2, "B", 2)
    assert [a for a, *_ in jobs.actions(moved)] == ["claimed", "claimed"]


# -- every ending, through the one method ------------------------------------------------------

_AT = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
_ERR = ValueError("x")


def _running(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t", request={"id": "m"})


def _retrying(jobs: Jobs, key: str) -> None:
    _running(jobs, key)
    jobs.store.end(key, RetryScheduled(1, "A", _ERR, _AT, "r"))


def _nothing(jobs: Jobs, key: str) -> None:
    pass


@dataclass(frozen=True)
class EndingCase:
    """``setup`` leaves the row ``ending`` is for; ``end`` then returns ``returned``, the row is
    ``state`` (status, generation, attempt, attempts) and its newest transition ``action``."""

    setup: Callable[[Jobs, str], None]
    ending: Callable[[Jobs, str], Ending]
    returned: bool
    state: tuple[str, int, str, int]
    action: str


_ENDINGS = {
    "Completion": EndingCase(
        _running,
        lambda j, k: Completion(1, "A", {"v": 1}),
        True,
        ("completed", 1, "A", 1),
        "completed",
    ),
    "RetryScheduled": EndingCase(
        _running,
        lambda j, k: RetryScheduled(1, "A", _ERR, _AT, "r"),
        True,
        ("retrying", 1, "A", 1),
        "retry_scheduled",
    ),
    "Dead": EndingCase(
        _running, lambda j, k: Dead(1, "A", _ERR, "d"), True, ("dead", 1, "A", 1), "dead"
    ),
    "CallerFailed": EndingCase(
        _running,
        lambda j, k: CallerFailed(1, "A", _ERR, "direct"),
        True,
        ("failed", 1, "A", 1),
        "failed",
    ),
    "DeadRefused": EndingCase(
        _nothing,
        lambda j, k: DeadRefused(1, "A", "t", None, _ERR, "refused"),
        True,
        ("dead", 1, "A", 1),
        "dead",
    ),
    "DeadUnregistered": EndingCase(
        _nothing,
        lambda j, k: DeadUnregistered("t", None, _ERR, "key"),
        True,
        ("dead", 0, "-", 0),
        "dead",
    ),
    "DeadUnrun": EndingCase(
        _retrying, lambda j, k: DeadUnrun("t", None, "expired"), True, ("dead", 1, "A", 1), "dead"
    ),
    "DeadStranded": EndingCase(
        _running,
        lambda j, k: DeadStranded(j.row(k), _ERR, "stranded"),
        True,
        ("dead", 1, "A", 1),
        "dead",
    ),
}


def test_the_cases_cover_every_ending() -> None:
    assert sorted(_ENDINGS) == sorted(t.__name__ for t in get_args(Ending))


@pytest.mark.parametrize("name", sorted(_ENDINGS))
def test_each_ending_is_applied_by_the_one_method(jobs: Jobs, key: str, name: str) -> None:
    case = _ENDINGS[name]
    case.setup(jobs, key)
    ending = case.ending(jobs, key)
    assert type(ending).__name__ == name
    assert jobs.store.end(key, ending) is case.returned
    assert _state(jobs.row(key)) == case.state
    assert jobs.actions(key)[-1][0] == case.action


#: The endings fenced on an attempt, each from generation 1 (attempt A).
_FENCED: dict[str, Ending] = {
    "Completion": Completion(1, "A", "late"),
    "RetryScheduled": RetryScheduled(1, "A", _ERR, _AT, "late"),
    "Dead": Dead(1, "A", _ERR, "late"),
    "CallerFailed": CallerFailed(1, "A", _ERR, "late"),
    "DeadRefused": DeadRefused(1, "A", "t", None, _ERR, "late"),
}


def test_the_fenced_cases_are_the_fenced_endings() -> None:
    assert sorted(_FENCED) == sorted(t.__name__ for t in FENCED_ENDINGS)


@pytest.mark.parametrize("name", sorted(_FENCED))
@pytest.mark.parametrize("newer", ["running", "retrying", "completed", "dead", "failed"])
def test_a_fenced_ending_of_an_older_generation_is_refused(
    jobs: Jobs, key: str, name: str, newer: str
) -> None:
    # Given generation 1 (attempt A) registered, then generation 2 (attempt B) in ``newer``,
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    if newer == "retrying":
        jobs.store.end(key, RetryScheduled(2, "B", None, _AT, "r"))
    elif newer == "completed":
        jobs.store.end(key, Completion(2, "B", {"by": "B"}))
    elif newer == "dead":
        jobs.store.end(key, Dead(2, "B", None, "d"))
    elif newer == "failed":
        jobs.store.end(key, CallerFailed(2, "B", None, "f"))
    before, history = jobs.row(key), jobs.actions(key)
    # when generation 1 ends the job,
    with pytest.raises(StaleGeneration) as stale:
        jobs.store.end(key, _FENCED[name])
    # then it is refused, says what it found, and nothing changed.
    assert (stale.value.context["stored_generation"], stale.value.context["stored_status"]) == (
        2,
        newer,
    )
    after = jobs.row(key)
    assert (_state(after), after.result, after.error_type) == (
        _state(before),
        before.result,
        before.error_type,
    )
    assert jobs.actions(key) == history


def test_a_failed_job_is_taken_by_a_newer_generation_its_attempts_counted_anew(
    jobs: Jobs, key: str
) -> None:
    # Given a job whose attempt in the caller's thread failed after a retried one
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.end(key, RetryScheduled(1, "A", _ERR, _AT, "r"))
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    jobs.store.end(key, CallerFailed(2, "B", _ERR, "raised in the caller's thread"))
    row = jobs.row(key)
    assert (_state(row), row.retry_at is None, row.finished_at is not None) == (
        ("failed", 2, "B", 2),
        True,
        True,
    )
    # an older or equal generation cannot take it; a newer one registers, attempts from 1
    assert jobs.store.register(key, generation=2, attempt_id="C", task_name="t").outcome == "stale"
    registration = jobs.store.register(key, generation=3, attempt_id="D", task_name="t")
    assert (registration.outcome, registration.attempts) == ("registered", 1)
    assert _state(jobs.row(key)) == ("running", 3, "D", 1)


# -- transitions: record, history, last_exit --------------------------------------------------


def test_record_appends_to_the_history_in_order(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.record(key, action=Action.LOST, generation=1, attempt_id="A", reason="x" * 300)
    jobs.store.record(key, action="busy", reason="")
    assert jobs.actions(key) == [
        ("claimed", 1, "A", None),
        ("lost", 1, "A", "x" * 255),
        ("busy", None, None, None),
    ]
    assert jobs.store.transitions.history(f"{key}:other") == []


def test_last_exit_skips_claims_losses_and_interrupted_retries(jobs: Jobs, key: str) -> None:
    assert jobs.store.transitions.last_exit(key) is None
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    assert jobs.store.transitions.last_exit(key) is None
    jobs.store.record(key, action=Action.TIME_LIMIT, generation=1, attempt_id="A")
    jobs.store.end(
        key,
        RetryScheduled(
            generation=1,
            attempt_id="A",
            error=None,
            retry_at=dt.datetime.now(dt.timezone.utc),
            reason=f"{INTERRUPTED_BY} SystemExit",
        ),
    )
    jobs.store.record(key, action=Action.LOST, generation=1, attempt_id="A")
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    assert jobs.store.transitions.last_exit(key) == "time_limit"
    jobs.store.record(key, action=Action.STALE, generation=2, attempt_id="B")
    assert jobs.store.transitions.last_exit(key) == "stale"


def test_last_exit_skips_a_retry_without_a_reason(jobs: Jobs, key: str) -> None:
    """What SQL does: ``NOT (action = 'retry_scheduled' AND reason LIKE ...)`` is NULL, not
    true, for a NULL reason, so that row is skipped like an interrupted one."""
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.record(key, action=Action.BUSY)
    jobs.store.end(
        key,
        RetryScheduled(
            generation=1,
            attempt_id="A",
            error=None,
            retry_at=dt.datetime.now(dt.timezone.utc),
            reason="",
        ),
    )
    assert jobs.store.transitions.last_exit(key) == "busy"
    jobs.store.register(key, generation=2, attempt_id="B", task_name="t")
    jobs.store.end(
        key,
        RetryScheduled(
            generation=2,
            attempt_id="B",
            error=None,
            retry_at=dt.datetime.now(dt.timezone.utc),
            reason="failed",
        ),
    )
    assert jobs.store.transitions.last_exit(key) == "retry_scheduled"


def test_without_transitions_the_state_still_moves(
    make_jobs: Callable[..., Jobs], key: str
) -> None:
    jobs = make_jobs(record_transitions=False)
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    jobs.store.record(key, action=Action.BUSY)
    jobs.store.end(key, Completion(generation=1, attempt_id="A", result=1))
    assert _state(jobs.row(key)) == ("completed", 1, "A", 1)
    assert jobs.actions(key) == []
    assert jobs.store.transitions.last_exit(key) is None


def test_concurrent_completions_of_one_attempt_store_one_result(jobs: Jobs, key: str) -> None:
    jobs.store.register(key, generation=1, attempt_id="A", task_name="t")
    outcomes = _race(
        8, lambda i: jobs.store.end(key, Completion(generation=1, attempt_id="A", result=i))
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["StaleGeneration"] * 7 + ["bool"]
    winner = outcomes.index(True)
    row = jobs.row(key)
    assert (row.status, row.result) == ("completed", winner)
    assert [a for a, *_ in jobs.actions(key)] == ["claimed", "completed"]


def _race(n: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(i)`` from ``n`` threads started together: each one's return value or exception."""
    barrier = threading.Barrier(n)
    outcomes: list[Any] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = call(i)
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


# -- the lease side -------------------------------------------------------------------------------


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Leases:
    """A lease backend under test (real: Redis, or the double on a fake clock), its clock, and a
    raw view of its keyspace (Redis' ``GET`` and ``PTTL``, or the double's)."""

    kind: str
    prefix: str
    client: redis.Redis
    clock: FakeClock = field(default_factory=FakeClock)
    made: list[LeaseStore | MemoryLeaseStore] = field(default_factory=list)

    def make(self, generation_ttl: float = 600.0) -> LeaseStore | MemoryLeaseStore:
        """A backend whose generation counters live ``generation_ttl`` seconds; the raw view
        reads the last one made."""
        backend: LeaseStore | MemoryLeaseStore
        if self.kind == "redis":
            backend = LeaseStore(self.client, prefix=self.prefix, generation_ttl=generation_ttl)
        else:
            backend = MemoryLeaseStore(
                prefix=self.prefix, generation_ttl=generation_ttl, clock=self.clock
            )
        self.made.append(backend)
        return backend

    @property
    def backend(self) -> LeaseStore | MemoryLeaseStore:
        """The backend with the default counter lifetime (600 s)."""
        return self.made[0] if self.made else self.make()

    def wait(self, seconds: float) -> None:
        if self.kind == "redis":
            time.sleep(seconds)
        else:
            self.clock.now += seconds

    def raw_get(self, name: str) -> str | None:
        last = self.made[-1]
        if isinstance(last, MemoryLeaseStore):
            return last.get(name)
        value = self.client.get(name)
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def raw_pttl(self, name: str) -> int:
        last = self.made[-1]
        if isinstance(last, MemoryLeaseStore):
            return last.pttl(name)
        return int(self.client.pttl(name))


@pytest.fixture(params=["redis", "memory"])
def lease_side(request: pytest.FixtureRequest, prefix: str, redis_client: redis.Redis) -> Leases:
    """The real lease store on this test's Redis prefix, or the double."""
    return Leases(request.param, prefix, redis_client)


def test_keys_for_is_the_same_layout(lease_side: Leases) -> None:
    keys = lease_side.backend.keys_for("report:1")
    assert keys == LeaseStore(None, prefix=keys.lease.split(":")[0]).keys_for("report:1")
    assert keys.lease.endswith(":lease") and keys.generation.endswith(":gen")


def test_a_claim_takes_the_next_generation_and_the_lease(lease_side: Leases) -> None:
    b = lease_side.backend
    keys = b.keys_for("k")
    g1 = b.claim("k", "tok-a", 5_000)
    assert g1 == 1
    assert (
        lease_side.raw_get(keys.lease) == "tok-a:1" and lease_side.raw_get(keys.generation) == "1"
    )
    assert 4_000 < lease_side.raw_pttl(keys.lease) <= 5_000
    assert 599_000 < lease_side.raw_pttl(keys.generation) <= 600_000
    assert b.release(keys.lease, "tok-a:1")
    assert b.claim("k", "tok-b", 5_000) == 2


def test_a_live_lease_is_busy_and_costs_no_generation(lease_side: Leases) -> None:
    b = lease_side.backend
    b.claim("k", "tok-a", 3_000)
    with pytest.raises(LeaseBusy) as busy:
        b.claim("k", "tok-b", 3_000)
    assert 2.5 < busy.value.remaining <= 3.0
    assert busy.value.context["remaining"] == busy.value.remaining
    keys = b.keys_for("k")
    assert (lease_side.raw_get(keys.lease), lease_side.raw_get(keys.generation)) == ("tok-a:1", "1")


def test_an_expired_lease_can_be_claimed(lease_side: Leases) -> None:
    b = lease_side.backend
    assert b.claim("k", "tok-a", 50) == 1
    lease_side.wait(0.12)
    assert b.remaining("k") == (None, None)
    assert b.claim("k", "tok-b", 1_000) == 2


def test_release_is_compare_and_delete(lease_side: Leases) -> None:
    b = lease_side.backend
    keys = b.keys_for("k")
    g = b.claim("k", "tok-a", 5_000)
    assert not b.release(keys.lease, f"tok-b:{g}")
    assert not b.release(keys.lease, f"tok-a:{g + 1}")
    assert lease_side.raw_get(keys.lease) == f"tok-a:{g}"
    assert b.release(keys.lease, "tok-a:")  # "<token>:" matches that attempt's lease
    assert lease_side.raw_get(keys.lease) is None
    assert not b.release(keys.lease, f"tok-a:{g}")
    b.raise_generation("k", 10)
    assert b.claim("k", "tok-a", 5_000) == 11
    assert not b.release(keys.lease, "tok-a:1")  # a whole value matches whole only
    assert b.release(keys.lease, "tok-a:11")


def test_releases_ride_in_the_claim_before_it(lease_side: Leases) -> None:
    b = lease_side.backend
    held = b.keys_for("k").lease
    g = b.claim("k", "tok-a", 5_000)
    other = b.keys_for("other").lease
    b.claim("other", "tok-o", 5_000)
    g2 = b.claim("k", "tok-b", 5_000, releases=[(held, f"tok-a:{g}"), (other, "tok-x:1")])
    assert g2 == g + 1
    assert lease_side.raw_get(held) == f"tok-b:{g2}"
    assert lease_side.raw_get(other) == "tok-o:1"  # a release that does not match removes nothing


def test_renew_extends_only_the_owners_live_lease(lease_side: Leases) -> None:
    b = lease_side.backend
    keys = b.keys_for("k")
    g = b.claim("k", "tok-a", 1_000)
    assert b.renew(keys.lease, f"tok-a:{g}", 5_000)
    assert 4_000 < lease_side.raw_pttl(keys.lease) <= 5_000
    assert not b.renew(keys.lease, f"tok-b:{g}", 5_000)
    assert not b.renew(keys.lease, "tok-a:", 5_000)  # no prefix match for a renewal
    assert b.renew(keys.lease, f"tok-a:{g}", 50)
    lease_side.wait(0.12)
    assert not b.renew(keys.lease, f"tok-a:{g}", 5_000)  # an expired lease is never revived
    assert lease_side.raw_get(keys.lease) is None


def test_raise_generation_is_set_if_greater(lease_side: Leases) -> None:
    b = lease_side.backend
    assert b.raise_generation("k", 41) == 41
    assert b.raise_generation("k", 7) == 41
    assert 599_000 < lease_side.raw_pttl(b.keys_for("k").generation) <= 600_000
    assert b.claim("k", "tok", 1_000) == 42


def test_take_generation_counts_without_a_lease(lease_side: Leases) -> None:
    b = lease_side.backend
    assert b.take_generation("k") == 1
    assert b.take_generation("k") == 2
    assert b.remaining("k") == (None, None)
    assert b.claim("k", "tok", 1_000) == 3


def test_batch_renews_and_releases(lease_side: Leases) -> None:
    b = lease_side.backend
    assert b.batch([], []) == ([], [])
    held = [
        (b.keys_for(f"k{i}").lease, f"t{i}:{b.claim(f'k{i}', f't{i}', 1_000)}") for i in range(4)
    ]
    renewed, released = b.batch(
        [(k, v, 5_000) for k, v in held[:2]] + [(held[2][0], "x:1", 5_000)],
        [held[3], (held[2][0], "x:1")],
    )
    assert (renewed, released) == ([True, True, False], [True, False])
    assert all(4_000 < lease_side.raw_pttl(k) <= 5_000 for k, _ in held[:2])
    assert lease_side.raw_get(held[3][0]) is None and lease_side.raw_get(held[2][0]) == held[2][1]


def test_remaining_reads_the_live_lease(lease_side: Leases) -> None:
    b = lease_side.backend
    assert b.remaining("k") == (None, None)
    g = b.claim("k", "tok", 2_000)
    seconds, generation = b.remaining("k")
    assert seconds is not None and 1.5 < seconds <= 2.0
    assert generation == g


def test_an_expired_counter_starts_again_and_is_raised_back(lease_side: Leases) -> None:
    b = lease_side.make(0.3)  # generation counters live 300 ms after their last claim
    keys = b.keys_for("k")
    assert b.claim("k", "a", 30) == 1
    b.release(keys.lease, "a:1")
    assert b.claim("k", "b", 30) == 2
    lease_side.wait(0.35)
    assert b.claim("k", "c", 30) == 1  # what a lost counter does: the store fences it
    assert b.raise_generation("k", 2) == 2
    assert 0 < lease_side.raw_pttl(keys.generation) <= 300
    lease_side.wait(0.05)
    assert b.claim("k", "d", 30) == 3


def test_a_counter_without_expiry_keeps_counting(lease_side: Leases) -> None:
    b = lease_side.make(0)
    b.claim("k", "a", 30)
    assert lease_side.raw_pttl(b.keys_for("k").generation) == -1
    assert b.take_generation("k") == 2
    assert b.raise_generation("k", 5) == 5
    assert lease_side.raw_pttl(b.keys_for("k").generation) == -1


def test_concurrent_claims_hand_out_one_lease(lease_side: Leases) -> None:
    b = lease_side.backend
    outcomes = _race(8, lambda i: b.claim("k", f"tok-{i}", 5_000))
    assert sorted(str(o) if isinstance(o, int) else type(o).__name__ for o in outcomes) == [
        "1",
        *["LeaseBusy"] * 7,
    ]
    winner = outcomes.index(1)
    assert lease_side.raw_get(b.keys_for("k").lease) == f"tok-{winner}:1"
    assert lease_side.raw_get(b.keys_for("k").generation) == "1"
