"""The checker of the limit scenarios (``group``, ``rate``): the ``limits broken`` column and
what was measured, from the ledger (what each body really did) and the harness's own samples.

``group`` (one entry a run in ``measures["group"]``): each attempt's span runs from its body's
``start`` to its ``end``, or to the moment the harness SIGKILLed it (``killed``). The most spans
open at one instant is the ledger's count; the harness also sampled the running set every
:data:`~celery_fence.chaos.scenarios_limits.SAMPLE_EVERY` seconds. A run whose either count
exceeds the group limit breaks it once; so does each kill whose slot was not free again within
one TTL (plus :data:`SLOT_BACK_SLACK` for the harness's polling) after the SIGKILL.

``rate`` (``measures["rate"]``): the body starts of the run's jobs in ``[t0, t0 + duration)``
(``t0``: the run's first start; the harness keeps more jobs queued than the window can take), as
tasks a second against the target. A run outside +/- :data:`RATE_TOLERANCE` of it breaks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_fence.chaos.checker import ScenarioResult

#: The relative error a measured rate may have (the issue: within 10 % over a minute).
RATE_TOLERANCE = 0.10
#: Seconds a killed holder's slot may take beyond one TTL to be seen free: the harness polls
#: the slot every 10 ms from a loaded machine.
SLOT_BACK_SLACK = 0.25


def _events(ledger: Mapping[str, list[dict[str, Any]]], keys: Sequence[str]) -> list[dict]:
    return [e for k in keys for e in ledger.get(k, [])]


def spans(events: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) of each attempt's body: its ``end``, else its ``killed``; a body with
    neither (it never returned and was not killed by the harness) is open to the last event."""
    last = max((float(e["t"]) for e in events), default=0.0)
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    for e in events:
        attempt = str(e.get("attempt"))
        if e["ev"] == "start":
            starts[attempt] = float(e["t"])
        elif e["ev"] in ("end", "killed"):
            ends.setdefault(attempt, float(e["t"]))
    return [(t, ends.get(a, last)) for a, t in starts.items()]


def max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = best = 0
    for _, step in points:
        running += step
        best = max(best, running)
    return best


def _check_group(
    result: ScenarioResult, runs: Sequence[Mapping[str, Any]], ledger: Mapping[str, Any]
) -> None:
    most = sampled = 0
    backs: list[float] = []
    for run in runs:
        limit, ttl = int(run["limit"]), float(run["ttl"])
        ledger_max = max_overlap(spans(_events(ledger, run["keys"])))
        sample_max = int(run["samples_max"])
        most, sampled = max(most, ledger_max), max(sampled, sample_max)
        if ledger_max > limit or sample_max > limit:
            result.limits_broken += 1
            result.violations.append(
                f"group limit broken: run {run['run'] + 1} ran {max(ledger_max, sample_max)} "
                f"attempts of the group at once (limit {limit}; ledger {ledger_max}, sampled "
                f"{sample_max} over {run['samples']} samples)"
            )
        for kill in run["kills"]:
            back = kill.get("slot_back_s")
            if back is None:
                continue  # no slot was held (the control arm has none)
            backs.append(float(back))
            if back > ttl + SLOT_BACK_SLACK:
                result.limits_broken += 1
                result.violations.append(
                    f"slot not back: run {run['run'] + 1} the killed holder's slot of "
                    f"{kill['key']} was free {back:.2f}s after the SIGKILL (TTL {ttl}s)"
                )
    result.measured.update(
        {
            "group_limit": int(runs[0]["limit"]),
            "group_limit_enforced": bool(runs[0]["enforced"]),
            "max_running_ledger": most,
            "max_running_sampled": sampled,
            "samples": sum(int(r["samples"]) for r in runs),
            "kills": sum(len(r["kills"]) for r in runs),
            "slot_back_s": [round(b, 3) for b in backs],
            "max_slot_back_s": round(max(backs), 3) if backs else None,
            "ttl": float(runs[0]["ttl"]),
        }
    )


def _check_rate(
    result: ScenarioResult, runs: Sequence[Mapping[str, Any]], ledger: Mapping[str, Any]
) -> None:
    rates: list[float] = []
    notes: list[str] = []
    for run in runs:
        starts = sorted(float(e["t"]) for e in _events(ledger, run["keys"]) if e["ev"] == "start")
        target, duration = float(run["target_per_s"]), float(run["duration"])
        if not starts:
            result.limits_broken += 1
            result.violations.append(f"rate: run {run['run'] + 1} started no body")
            continue
        t0 = starts[0]
        inside = sum(1 for t in starts if t < t0 + duration)
        measured = inside / duration
        rates.append(measured)
        error = measured / target - 1
        if abs(error) > RATE_TOLERANCE:
            result.limits_broken += 1
            result.violations.append(
                f"rate not kept: run {run['run'] + 1} started {inside} bodies in {duration:.0f}s "
                f"({measured:.3f}/s, {error:+.1%} of the target {run['rate']} across "
                f"{run['workers']} workers; tolerance +/-{RATE_TOLERANCE:.0%})"
            )
        if starts[-1] < t0 + duration * 0.95:
            notes.append(
                f"run {run['run'] + 1} ran out of queued jobs {t0 + duration - starts[-1]:.1f}s "
                "before its window ended: its rate is a lower bound"
            )
    first = runs[0]
    result.measured.update(
        {
            "rate": first["rate"],
            "target_per_s": float(first["target_per_s"]),
            "duration_s": float(first["duration"]),
            "workers": int(first["workers"]),
            "fence_rate_limit": not bool(first["celery_rate_limit"]),
            "measured_per_s": [round(r, 4) for r in rates],
            "relative_error": [round(r / float(first["target_per_s"]) - 1, 4) for r in rates],
            "kills": sum(len(r["kills"]) for r in runs),
            "notes": notes,
        }
    )


def check(
    result: ScenarioResult,
    measures: Mapping[str, Sequence[Mapping[str, Any]]],
    ledger: Mapping[str, list[dict[str, Any]]],
) -> ScenarioResult:
    """Fill ``limits_broken`` and ``measured`` of ``result`` from the runs' ``measures``."""
    if measures.get("group"):
        _check_group(result, measures["group"], ledger)
    if measures.get("rate"):
        _check_rate(result, measures["rate"], ledger)
    return result


__all__ = ["RATE_TOLERANCE", "SLOT_BACK_SLACK", "check", "max_overlap", "spans"]
