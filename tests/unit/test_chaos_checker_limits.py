"""The limit scenarios' checker: the most attempts of a group open at once (spans from the
ledger, a killed attempt's ending at its kill), a killed holder's slot back within one TTL, and a
rate within 10 % of its target; each rule fires on a history that breaks it."""

from __future__ import annotations

from typing import Any

from celery_fence.chaos.checker import ScenarioResult
from celery_fence.chaos.checker_limits import check, max_overlap, spans


def _ev(ev: str, key: str, attempt: str, t: float) -> dict[str, Any]:
    return {"ev": ev, "key": key, "gen": 1, "attempt": attempt, "t": t}


def _group_run(
    ledger: dict[str, list[dict[str, Any]]], *, samples_max: int, back: float | None = 1.0
) -> dict[str, Any]:
    kill = {"attempt": "a1", "key": "k1", "t": 1.5, "slot_back_s": back}
    return {
        "run": 0,
        "limit": 2,
        "enforced": True,
        "ttl": 1.5,
        "keys": sorted(ledger),
        "samples": 100,
        "samples_max": samples_max,
        "kills": [kill],
    }


def test_max_overlap_counts_an_end_before_a_start_at_the_same_instant() -> None:
    assert max_overlap([(0, 1), (1, 2), (2, 3)]) == 1
    assert max_overlap([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert max_overlap([]) == 0


def test_a_killed_attempt_s_span_ends_at_its_kill() -> None:
    events = [
        _ev("start", "k1", "a1", 1.0),
        _ev("killed", "k1", "a1", 1.5),
        _ev("start", "k1", "a2", 4.0),
        _ev("end", "k1", "a2", 5.0),
    ]
    assert sorted(spans(events)) == [(1.0, 1.5), (4.0, 5.0)]


def _three_at_once() -> dict[str, list[dict[str, Any]]]:
    return {
        "k1": [_ev("start", "k1", "a1", 1.0), _ev("killed", "k1", "a1", 1.5)],
        "k2": [_ev("start", "k2", "b1", 1.2), _ev("end", "k2", "b1", 2.0)],
        "k3": [_ev("start", "k3", "c1", 1.4), _ev("end", "k3", "c1", 2.0)],
    }


def test_a_group_over_its_limit_in_the_ledger_breaks_it() -> None:
    ledger = _three_at_once()
    result = check(
        ScenarioResult("group", runs=1), {"group": [_group_run(ledger, samples_max=2)]}, ledger
    )
    assert result.limits_broken == 1, result.violations
    assert result.measured["max_running_ledger"] == 3
    assert "ran 3 attempts of the group at once (limit 2" in result.violations[0]


def test_a_group_over_its_limit_in_the_samples_alone_breaks_it() -> None:
    ledger = _three_at_once()
    ledger["k3"] = [_ev("start", "k3", "c1", 1.6), _ev("end", "k3", "c1", 2.0)]  # after the kill
    run = _group_run(ledger, samples_max=3)
    result = check(ScenarioResult("group", runs=1), {"group": [run]}, ledger)
    assert result.measured["max_running_ledger"] == 2
    assert result.limits_broken == 1, result.violations


def test_a_slot_back_later_than_one_ttl_breaks_the_limit() -> None:
    ledger = {"k1": [_ev("start", "k1", "a1", 1.0), _ev("killed", "k1", "a1", 1.5)]}
    on_time = check(ScenarioResult("group"), {"group": [_group_run(ledger, samples_max=1)]}, ledger)
    assert on_time.limits_broken == 0 and on_time.measured["max_slot_back_s"] == 1.0
    late = _group_run(ledger, samples_max=1, back=2.5)
    result = check(ScenarioResult("group"), {"group": [late]}, ledger)
    assert result.limits_broken == 1
    assert "free 2.50s after the SIGKILL (TTL 1.5s)" in result.violations[0]


def _rate_run(starts: int, duration: float = 10.0) -> tuple[dict[str, Any], dict[str, Any]]:
    ledger = {
        f"k{n}": [_ev("start", f"k{n}", f"a{n}", 100.0 + n * duration / starts)]
        for n in range(starts + 5)  # the queue outlasts the window
    }
    run = {
        "run": 0,
        "rate": "2/s",
        "target_per_s": 2.0,
        "duration": duration,
        "workers": 3,
        "celery_rate_limit": False,
        "keys": sorted(ledger),
        "kills": [],
    }
    return run, ledger


def test_a_rate_within_ten_percent_of_its_target_is_kept() -> None:
    run, ledger = _rate_run(21)  # 21 starts in 10 s, the first at t0: 2.1/s
    result = check(ScenarioResult("rate", runs=1), {"rate": [run]}, ledger)
    assert result.limits_broken == 0, result.violations
    assert result.measured["relative_error"] == [0.05]


def test_a_rate_three_times_its_target_breaks_it() -> None:
    run, ledger = _rate_run(60)
    result = check(ScenarioResult("rate", runs=1), {"rate": [run]}, ledger)
    assert result.limits_broken == 1
    assert result.measured["measured_per_s"] == [6.0]
    assert "+200.0% of the target 2/s across 3 workers" in result.violations[0]


def test_a_rate_well_below_its_target_breaks_it_too() -> None:
    run, ledger = _rate_run(15)
    result = check(ScenarioResult("rate", runs=1), {"rate": [run]}, ledger)
    assert result.limits_broken == 1
