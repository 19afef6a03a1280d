"""The chaos checker compares the store's history with the workload's ledger, and requires its
evidence: each rule below fires on a history that breaks it (a SQLite store, no services)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from celery_fence.chaos import app_metadata
from celery_fence.chaos.arms import UnfencedStore
from celery_fence.chaos.checker import Job, ScenarioResult, check
from celery_fence.store import Store
from celery_fence.store.records import Completion


def _store(tmp_path: Path, store_class: type[Store] = Store, **kw: Any) -> Store:
    store = store_class(f"sqlite:///{tmp_path / 'store.sqlite3'}", **kw)
    store.create_schema()
    app_metadata.create_all(store.engine)
    return store


def _ev(ev: str, gen: int, attempt: str, **extra: Any) -> dict[str, Any]:
    # the ledger entries are older than the store writes the tests make afterwards
    return {"ev": ev, "key": "k", "gen": gen, "attempt": attempt, "t": time.time() - 60, **extra}


def _check(store: Store, events: list[dict[str, Any]], **job: Any) -> ScenarioResult:
    result = ScenarioResult("s", runs=1)
    done = Job("k", finished=True, **job)
    return check(result, [done], store, {"k": events}, {"by_key": {}})


def test_a_clean_history_with_its_witness_reads_zero(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.end("k", Completion(generation=1, attempt_id="a1", result={"generation": 1}))
    events = [_ev("start", 1, "a1"), _ev("outcome", 1, "a1", outcome="completed")]
    result = _check(store, events)
    assert result.safe, result.violations


def test_an_attempt_told_completed_after_a_newer_generation_started_is_a_stale_write(
    tmp_path: Path,
) -> None:
    # Given a store that answered generation 1 "completed" although generation 2 had started
    # (what a completion predicate without the generation would do; the store's own row looks fine)
    store = _store(tmp_path)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.register("k", generation=2, attempt_id="a2", task_name="t")
    store.end("k", Completion(generation=2, attempt_id="a2", result={"generation": 2}))
    events = [
        _ev("start", 1, "a1"),
        _ev("start", 2, "a2"),
        _ev("outcome", 1, "a1", outcome="completed"),
        _ev("outcome", 2, "a2", outcome="completed"),
    ]
    result = _check(store, events)
    # then the witness counts it, and the two accepted completions
    assert result.stale_writes == 1 and result.duplicate_completions == 1, result.violations


def test_one_generation_started_by_two_attempts_is_claimed_twice(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.register("k", generation=1, attempt_id="a2", task_name="t")
    store.end("k", Completion(generation=1, attempt_id="a2", result={"generation": 1}))
    events = [
        _ev("start", 1, "a1"),
        _ev("start", 1, "a2"),
        _ev("outcome", 1, "a2", outcome="completed"),
    ]
    result = _check(store, events)
    assert result.generations_claimed_twice == 1, result.violations


def test_no_transition_rows_or_no_witness_is_not_read_as_zero(tmp_path: Path) -> None:
    # Given a completed job whose store recorded no transition and whose ledger is empty,
    store = _store(tmp_path, record_transitions=False)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.end("k", Completion(generation=1, attempt_id="a1", result={"generation": 1}))
    result = _check(store, [])
    # then the checker says it has no evidence, instead of a row of zeros.
    assert result.unexpected_outcomes == 1 and not result.safe
    text = "\n".join(result.violations)
    assert "no transition rows" in text
    assert "no attempt recorded that the store accepted its completion" in text
    assert "never started a body" in text


def test_a_caller_that_got_another_result_is_an_unexpected_outcome(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.end("k", Completion(generation=1, attempt_id="a1", result={"generation": 1}))
    events = [_ev("start", 1, "a1"), _ev("outcome", 1, "a1", outcome="completed")]
    result = _check(store, events, results=[{"generation": 1}, {"generation": 7}])
    assert result.unexpected_outcomes == 1
    assert any("not the stored one" in v for v in result.violations)


def test_a_skipped_or_aborted_scenario_is_not_safe() -> None:
    assert not ScenarioResult("s", skipped="needs PostgreSQL").safe
    assert not ScenarioResult("s", runs=2, error="run 3 aborted").safe
    assert not ScenarioResult("s").safe  # nothing ran
    assert ScenarioResult("s", runs=1).safe


def test_a_stale_write_seen_by_the_witness_and_the_history_counts_once(tmp_path: Path) -> None:
    # Given a store without its fence that accepts generation 1's completion after generation 2
    # registered: the store's history shows it (completed by 1 after claimed by 2), and so does
    # the witness (attempt a1 told "completed" after generation 2 started),
    store = _store(tmp_path, UnfencedStore)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.register("k", generation=2, attempt_id="a2", task_name="t")
    store.end("k", Completion(generation=1, attempt_id="a1", result={"generation": 1}))
    events = [
        _ev("start", 1, "a1"),
        _ev("start", 2, "a2"),
        _ev("outcome", 1, "a1", outcome="completed"),
    ]
    result = _check(store, events)
    # then the one write counts once (it was counted by each finding).
    assert result.stale_writes == 1, result.violations


def test_redis_loss_counts_a_lost_counter_whether_or_not_the_fence_reacts() -> None:
    from celery_fence.chaos.scenarios import regressions

    # the fence took its regression branch, then claimed generation 2
    fenced = [_ev("start", 1, "a1"), _ev("regressed", 1, "a2"), _ev("start", 2, "a2")]
    # no fence: the second attempt started with the generation the first one had
    unfenced = [_ev("start", 1, "a1"), _ev("start", 1, "a2")]
    assert regressions(fenced) == 1
    assert regressions(unfenced) == 1
    assert regressions([_ev("start", 1, "a1"), _ev("start", 2, "a2")]) == 0


def test_a_write_beside_a_block_committed_after_a_newer_attempt_started_is_a_stale_app_write(
    tmp_path: Path,
) -> None:
    # Given generation 2 started, then generation 1's write beside its block committed (the
    # beside-block scenario's ledger), and generation 2 completed,
    store = _store(tmp_path)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.register("k", generation=2, attempt_id="a2", task_name="t")
    store.end("k", Completion(generation=2, attempt_id="a2", result={"generation": 2}))
    start = _ev("start", 2, "a2")
    events = [
        _ev("start", 1, "a1"),
        start,
        _ev("beside_committed", 1, "a1", t0=start["t"] + 1.0, form="do"),
        _ev("outcome", 1, "a1", outcome="stale"),
        _ev("outcome", 2, "a2", outcome="completed"),
    ]
    result = _check(store, events)
    # then it is a stale app-table write, named with its form;
    assert result.stale_app_writes == 1, result.violations
    assert any("beside its block (do)" in v for v in result.violations), result.violations
    # refused (no beside_committed), or committed before the newer attempt started, it is not.
    events[2] = _ev("beside_refused", 1, "a1", form="do")
    assert _check(store, events).stale_app_writes == 0
    events[2] = _ev("beside_committed", 1, "a1", t0=start["t"] - 1.0, form="do")
    assert _check(store, events).stale_app_writes == 0


def test_copies_of_one_job_stored_under_keys_of_their_own_are_duplicate_completions(
    tmp_path: Path,
) -> None:
    # Given a clean history whose job the harness counted twice more under keys of their own (a
    # plain beat's copies of one tick), then the copies are duplicate completions, named.
    store = _store(tmp_path)
    store.register("k", generation=1, attempt_id="a1", task_name="t")
    store.end("k", Completion(generation=1, attempt_id="a1", result={"generation": 1}))
    events = [_ev("start", 1, "a1"), _ev("outcome", 1, "a1", outcome="completed")]
    result = _check(store, events, extra_completions=2)
    assert result.duplicate_completions == 2 and not result.safe
    assert any("completed 3 times under keys of their own" in v for v in result.violations)
    assert _check(store, events).duplicate_completions == 0
