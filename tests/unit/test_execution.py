"""One execution's orchestration (claim -> register -> body -> settle) on the in-memory doubles of
the store and the lease store (themselves checked against the real ones in
``tests/integration/test_doubles_contract.py``): milliseconds per test, no worker, no server.
The failure windows with real workers and signals are in ``tests/acceptance``."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery.exceptions import Retry
from sqlalchemy import exc as sa_exc

from celery_fence.body.fence import Fence
from celery_fence.config import FenceConfig
from celery_fence.errors import (
    ConfigurationError,
    FenceError,
    JobDead,
    LeaseLost,
    ResultNotSerializable,
    StaleGeneration,
)
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline.claim import Claim
from celery_fence.pipeline.execution import CLAIM_ROUNDS, Execution
from celery_fence.pipeline.exits import settle_exit
from celery_fence.pipeline.retry import RetryPolicy
from celery_fence.store.records import Completion, DeadUnrun, Ending, RetryScheduled
from tests.support.memory import MemoryLeaseStore, MemoryStore

KEY = "job:1"


class NoBudget:
    """A retry budget that never delays."""

    def record_call(self, name: str) -> None:
        pass

    def spend(self, name: str) -> float:
        return 0.0


class Heard:
    """The announcer: records the actions announced."""

    def __init__(self) -> None:
        self.actions: list[str] = []

    def __call__(self, action: Any, **_: Any) -> None:
        self.actions.append(str(action))


class Run:
    """One execution on doubles, and what the test needs to look at afterwards."""

    def __init__(
        self,
        store: MemoryStore | None = None,
        leases: MemoryLeaseStore | None = None,
        renewer: Renewer | None = None,
        **settings: Any,
    ) -> None:
        self.config = FenceConfig(lease_ttl=2.0, renew_interval=0.5, max_attempts=3, **settings)
        self.store = store or MemoryStore()
        self.leases = leases or MemoryLeaseStore(generation_ttl=self.config.generation_ttl)
        self.renewer = renewer or Renewer(self.leases)  # one per process, as a worker's
        self.heard = Heard()
        self.execution = self.of(KEY)
        self.bodies: list[Fence] = []

    def of(self, key: str) -> Execution:
        """An execution of the job ``key`` on these doubles."""
        return Execution(
            key,
            task_name="t",
            config=self.config,
            store=self.store,
            leases=self.leases,
            renewer=self.renewer,
            policy=RetryPolicy(self.config, budget=NoBudget()),  # type: ignore[arg-type]
            announcer=self.heard,  # type: ignore[arg-type]
        )

    def __call__(
        self,
        body: Callable[[Fence], Any] = lambda fence: {"generation": fence.generation},
    ) -> o.Disposition:
        def recorded(fence: Fence) -> Any:
            self.bodies.append(fence)
            return body(fence)

        return self.execution.run(
            recorded,
            request_json=lambda: '{"task": "t", "args": [1], "kwargs": {}}',
            max_runtime=None,
        )

    def status(self) -> str | None:
        record = self.store.get(KEY)
        return None if record is None else record.status


@pytest.fixture
def run() -> Iterator[Run]:
    runs: list[Run] = []

    def make(**kw: Any) -> Run:
        runs.append(Run(**kw))
        return runs[-1]

    yield make  # type: ignore[misc]
    for r in runs:
        r.renewer.stop()


def test_a_completion_claims_registers_runs_and_completes_once(run: Any) -> None:
    r = run()
    action = r()
    assert action == o.Return({"generation": 1})
    record = r.store.get(KEY)
    assert record is not None and (record.status, record.generation, record.result) == (
        "completed",
        1,
        {"generation": 1},
    )
    assert r.heard.actions == ["claimed", "completed"]
    # the lease goes back by its token, batched with the next claim
    lease = r.bodies[0].lease
    assert (lease.lease_key, lease.value) in r.renewer.pending_releases


def test_a_completed_job_replays_its_result_without_running_the_body(run: Any) -> None:
    r = run()
    r()
    again = Run(store=r.store, leases=r.leases, renewer=r.renewer)
    action = again()
    assert action == o.Return({"generation": 1}, deliver=KEY, replay=True)
    assert again.bodies == [] and again.heard.actions == ["claimed", "replayed"]


def test_a_held_lease_reschedules_past_its_remaining_time_and_never_runs(run: Any) -> None:
    r = run()
    r.leases.claim(KEY, "other", 2000)
    action = r()
    assert isinstance(action, o.Resend) and action.reason == "lease busy"
    assert 1.5 < action.countdown < 2.0 + r.config.renew_interval
    assert r.bodies == [] and r.status() is None


def test_a_counter_behind_the_store_is_raised_and_the_claim_taken_again(run: Any) -> None:
    # Given a store that registered generation 5 (Redis then lost its counter)
    store = MemoryStore()
    store.register(KEY, generation=5, attempt_id="old", task_name="t")
    store.end(
        KEY,
        RetryScheduled(
            generation=5,
            attempt_id="old",
            error=RuntimeError("x"),
            retry_at=store.get(KEY).updated_at,  # type: ignore[union-attr]
            reason="x",
        ),
    )
    r = run(store=store)
    # When an execution claims generation 1 from the fresh counter
    action = r()
    # Then it raised the counter above the store's and ran as generation 6
    assert action == o.Return({"generation": 6})
    assert r.heard.actions == ["claimed", "claimed", "completed"]
    assert [f.generation for f in r.bodies] == [6]


def test_a_counter_that_cannot_be_raised_reschedules_after_the_claim_rounds(run: Any) -> None:
    class Stuck(MemoryLeaseStore):
        def raise_generation(self, key: str, floor: int) -> int:
            return 0

    store = MemoryStore()
    store.register(KEY, generation=50, attempt_id="old", task_name="t")
    r = run(store=store, leases=Stuck())
    action = r()
    assert isinstance(action, o.Resend)
    assert action.reason == "generation regressed on every claim round"
    assert r.heard.actions.count("claimed") == CLAIM_ROUNDS and r.bodies == []


def test_a_request_the_database_refuses_is_recorded_dead_not_retried(run: Any) -> None:
    class Refusing(MemoryStore):
        def register(self, key: str, **kw: Any) -> Any:
            raise sa_exc.DataError("INSERT", {}, Exception("unsupported Unicode escape"))

    r = run(store=Refusing())
    action = r()
    assert isinstance(action, o.Fail) and isinstance(action.error, ResultNotSerializable)
    record = r.store.get(KEY)
    assert record is not None and record.status == "dead" and r.bodies == []


def test_a_claim_whose_reply_was_lost_releases_its_lease_by_token(run: Any) -> None:
    class Dropping(MemoryLeaseStore):
        def claim(self, key: str, token: str, ttl_ms: int, **kw: Any) -> int:
            super().claim(key, token, ttl_ms, **kw)  # the claim ran...
            raise ConnectionError("reply lost")  # ...and its answer was lost

    r = run(leases=Dropping())
    action = r()
    assert isinstance(action, o.Resend) and "lease store unavailable" in action.reason
    lease_key = r.leases.keys_for(KEY).lease
    assert (lease_key, f"{r.execution.attempt_id}:") in r.renewer.pending_releases
    # the token-prefix release matches the lost claim's lease, whatever its generation
    assert r.leases.release(lease_key, f"{r.execution.attempt_id}:")


def test_a_failing_body_schedules_a_retry(run: Any) -> None:
    r = run()

    def fail(fence: Fence) -> None:
        raise ValueError("boom")

    action = r(fail)
    assert isinstance(action, o.Resend) and r.status() == "retrying"
    assert r.heard.actions == ["claimed", "retry_scheduled"]


def test_the_third_failure_is_dead(run: Any) -> None:
    r = run()

    def fail(fence: Fence) -> None:
        raise ValueError("boom")

    for _ in range(2):
        assert isinstance(Run(store=r.store, leases=r.leases, renewer=r.renewer)(fail), o.Resend)
    action = r(fail)
    assert isinstance(action, o.Fail) and r.status() == "dead"


def test_executions_past_max_attempts_end_dead_without_running(run: Any) -> None:
    # Given three earlier executions that died without a word (their worker was lost)
    store = MemoryStore()
    for generation in (1, 2, 3):
        store.register(KEY, generation=generation, attempt_id=f"a{generation}", task_name="t")
    leases = MemoryLeaseStore()
    leases.raise_generation(KEY, 3)
    r = run(store=store, leases=leases)
    action = r()
    assert isinstance(action, o.Fail) and isinstance(action.error, JobDead)
    record = store.get(KEY)
    assert record is not None and (record.status, record.attempts) == ("dead", 3)
    assert r.bodies == []


def test_a_lost_lease_in_the_body_schedules_a_retry(run: Any) -> None:
    r = run()

    def lose(fence: Fence) -> None:
        raise LeaseLost("lost", key=fence.key, generation=fence.generation)

    action = r(lose)
    assert isinstance(action, o.Resend) and action.reason == "lease lost"
    assert r.status() == "retrying"


def test_a_completion_after_a_newer_generation_registered_converges_on_it(run: Any) -> None:
    r = run()

    def superseded(fence: Fence) -> dict[str, int]:
        # a newer generation takes the job over and completes it while this body runs
        r.store.register(KEY, generation=fence.generation + 1, attempt_id="new", task_name="t")
        r.store.end(
            KEY, Completion(generation=fence.generation + 1, attempt_id="new", result="newer")
        )
        return {"mine": 1}

    action = r(superseded)
    assert action == o.Return("newer")
    record = r.store.get(KEY)
    assert record is not None and (record.result, record.generation) == ("newer", 2)
    assert "stale" in r.heard.actions


def test_a_stale_write_in_the_body_converges_or_comes_back(run: Any) -> None:
    r = run()

    def stale(fence: Fence) -> None:
        r.store.register(KEY, generation=fence.generation + 1, attempt_id="new", task_name="t")
        raise StaleGeneration("newer", stored_generation=fence.generation + 1)

    action = r(stale)
    assert isinstance(action, o.Resend) and "still running" in action.reason
    record = r.store.get(KEY)
    assert record is not None and (record.status, record.attempt_id) == ("running", "new")


def test_the_bodys_own_retry_keeps_celerys_meaning_and_the_row_says_it(run: Any) -> None:
    r = run()

    def retry(fence: Fence) -> None:
        raise Retry("again", when=5)

    action = r(retry)
    assert isinstance(action, o.Reraise) and isinstance(action.error, Retry)
    assert r.status() == "retrying"


def test_an_exit_that_is_not_an_exception_is_settled(run: Any) -> None:
    r = run()

    def interrupted(fence: Fence) -> None:
        raise KeyboardInterrupt

    seen: list[o.Disposition] = []
    thread = threading.Thread(target=lambda: seen.append(r(interrupted)))
    thread.start()
    thread.join(5)
    # off the main thread it exits nothing: re-sent, never left running
    assert isinstance(seen[0], o.Resend) and r.status() == "retrying"
    # on the main thread Celery needs it raised on (the store says what happened first)
    again = Run(store=r.store, leases=r.leases, renewer=r.renewer)
    assert isinstance(again(interrupted), o.Reraise)


def test_an_unkeyed_message_is_recorded_dead_under_its_message_id(run: Any) -> None:
    r = run()
    unkeyed = o.Unkeyed(ConfigurationError("fence_key raised"), "msg-1", None)
    action = r.of("unkeyed:t:msg-1").settle(unkeyed)
    assert isinstance(action, o.Fail)
    record = r.store.get("unkeyed:t:msg-1")
    assert record is not None and record.status == "dead"


def test_a_hard_time_limit_gives_the_message_back_and_records_it(run: Any) -> None:
    r = run()
    action = settle_exit(r.execution, o.TimeLimited(3.0))
    assert action == o.Requeue("hard time limit 3.0s")
    assert [t.action for t in r.store.transitions.history(KEY)] == ["time_limit"]


def test_an_expired_message_of_a_new_job_is_recorded_dead(run: Any) -> None:
    r = run()
    action = settle_exit(r.execution, o.Unrun("expired", "m1", None, False, shared_key=True))
    assert action == o.Acknowledge() and r.status() == "dead"


def test_an_expired_message_goes_back_when_the_store_cannot_say(run: Any) -> None:
    class Down(MemoryStore):
        def end(self, key: str, ending: Ending) -> bool:
            if isinstance(ending, DeadUnrun):
                raise ConnectionError("database down")
            return super().end(key, ending)

    r = run(store=Down())
    action = settle_exit(r.execution, o.Unrun("revoked", "m1", None, False, shared_key=True))
    assert isinstance(action, o.Requeue) and r.status() is None


def test_the_claim_is_a_frozen_value_each_step_replaces(run: Any) -> None:
    # Given an execution built with its key: before the claim, only its token is known
    r = run()
    before = r.execution.claim
    assert (before.token, before.generation, before.registered) == (
        r.execution.attempt_id,
        None,
        False,
    )
    seen: list[Claim] = []
    # When it claims, registers and runs its body
    r(lambda fence: seen.append(r.execution.claim))
    # Then the body saw a registered claim of generation 1, a new value, and the value it
    # started with is unchanged (and cannot be changed)
    [during] = seen
    assert (during.generation, during.registered, during.attempts) == (1, True, 1)
    assert during.lease is not None and during.lease.token == r.execution.attempt_id
    assert before.generation is None and not before.registered
    with pytest.raises(dataclasses.FrozenInstanceError):
        during.generation = 2  # type: ignore[misc]


def test_an_execution_without_a_key_is_refused_with_a_clear_error(run: Any) -> None:
    with pytest.raises(FenceError, match="needs the key of its job"):
        run().of("")


def test_a_main_process_exit_settles_with_no_claim_and_writes_no_attempt(run: Any) -> None:
    # Given a key whose job is running under generation 1 of another attempt
    r = run()
    r.store.register(KEY, generation=1, attempt_id="other", task_name="t")
    # When the worker's main process settles a hard time limit and a revoke of another message
    assert settle_exit(r.of(KEY), o.TimeLimited(2.0)) == o.Requeue("hard time limit 2.0s")
    revoked = o.Unrun("revoked", "m2", None, False, shared_key=True)
    assert settle_exit(r.of(KEY), revoked) == o.Acknowledge()
    # Then the running attempt's row is untouched: history only, no generation written
    record = r.store.get(KEY)
    assert record is not None and (record.status, record.generation) == ("running", 1)
    assert [t.action for t in r.store.transitions.history(KEY)][-2:] == ["time_limit", "revoked"]


def test_with_metrics_on_a_takeover_is_counted_from_the_registration_alone(run: Any) -> None:
    from prometheus_client import CollectorRegistry

    from celery_fence import metrics
    from celery_fence.metrics.families import Metrics

    class Reads(MemoryStore):
        """The store double, counting the reads of a job row the pipeline makes."""

        reads = 0

        def get(self, key: str) -> Any:
            self.reads += 1
            return super().get(key)

    # Given a row an older generation left running (its worker froze), its lease expired,
    store = Reads()
    store.register(KEY, generation=1, attempt_id="frozen", task_name="t")
    leases = MemoryLeaseStore()
    leases.claim(KEY, "frozen", 2000)
    leases.release(leases.keys_for(KEY).lease, "frozen:1")
    registry = CollectorRegistry()
    previous, metrics.active = metrics.active, Metrics(registry)
    try:
        # when a new attempt with metrics on claims generation 2 and completes,
        r = run(store=store, leases=leases)
        assert r() == o.Return({"generation": 2})
    finally:
        metrics.active = previous
    # then the takeover is counted once, and no read of the row preceded the registration.
    labels = {"task": "t"}
    assert registry.get_sample_value("celery_fence_takeovers_total", labels) == 1
    assert registry.get_sample_value("celery_fence_takeover_seconds_count", labels) == 1
    assert store.reads == 0
