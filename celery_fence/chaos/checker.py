"""The checker: reads the history (store, transitions, outbox, ledger, provider) and counts.

The column definitions are in the package docstring (:mod:`celery_fence.chaos`); this module is
their implementation, one function per column, over one scenario's jobs.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa

from celery_fence.chaos import APP_ROWS, CHARGE
from celery_fence.ops.outbox import idempotency_key
from celery_fence.store import Store, Transition

#: Store writes that are fenced (each recorded in the same statement as the write itself).
FENCED_WRITES = ("claimed", "completed", "retry_scheduled", "dead")
#: Columns that must be zero; the harness exits 1 when one is not.
SAFETY_COLUMNS = (
    "stale_writes",
    "stale_app_writes",
    "generations_claimed_twice",
    "lost_jobs",
    "duplicate_completions",
    "duplicate_external_effects",
    "reruns_after_completion",
    "unexpected_outcomes",
    "limits_broken",
)
#: (field, header) in table order.
COLUMNS = (
    ("scenario", "scenario"),
    ("runs", "runs"),
    ("faults", "faults injected"),
    ("stale_refused", "stale attempts refused"),
    ("stale_writes", "stale writes accepted"),
    ("stale_app_writes", "stale app-table writes accepted"),
    ("generations_claimed_twice", "generation claimed twice"),
    ("lost_jobs", "lost jobs"),
    ("duplicate_completions", "duplicate completions"),
    ("duplicate_external_effects", "duplicate external effects"),
    ("reruns_after_completion", "body re-runs after completion"),
    ("unexpected_outcomes", "unexpected outcomes"),
    ("limits_broken", "limits broken"),
    ("max_converge_s", "max time to converge (s)"),
)


@dataclass
class Job:
    """One logical job a scenario submitted, and what the scenario expects of it."""

    key: str
    expect: str = "completed"  # or "dead"
    expect_attempts: int | None = None  # attempts counted by the store, when it matters
    expect_starts: int | None = None  # body starts in the ledger, when it matters
    expect_remote: bool = False  # a charge that timed out once must converge through its key
    expect_reason: str | None = None  # the reason of the terminal transition, when it matters
    expect_claims: int | None = None  # generations claimed in Redis, when it matters
    claims: int | None = None  # generations claimed, as the harness read them after the run
    #: What the harness itself saw go wrong around the job (e.g. a misconfigured worker started).
    observed: list[str] = field(default_factory=list)
    #: Completions of this logical job stored under other keys (e.g. plain beat replicas' copies
    #: of one tick, each a job of its own), as the harness counted them.
    extra_completions: int = 0
    task_ids: list[str] = field(default_factory=list)
    finished: bool = False  # every message of the job finished (SUCCESS or FAILURE)
    states: list[str] = field(default_factory=list)  # the final Celery state of each message
    results: list[Any] = field(default_factory=list)  # what each SUCCESS message returned


@dataclass
class ScenarioResult:
    scenario: str
    runs: int = 0
    faults: int = 0
    stale_refused: int = 0  # attempts that reached the store and were refused (the ledger)
    stale_writes: int = 0
    stale_app_writes: int = 0
    generations_claimed_twice: int = 0
    lost_jobs: int = 0
    duplicate_completions: int = 0
    duplicate_external_effects: int = 0
    reruns_after_completion: int = 0
    unexpected_outcomes: int = 0
    #: A cluster-wide limit not kept (:mod:`.checker_limits`: group and rate scenarios).
    limits_broken: int = 0
    max_converge_s: float = 0.0
    skipped: str | None = None
    error: str | None = None  # the harness itself failed (a step timed out): exit status 2
    violations: list[str] = field(default_factory=list)
    #: What the limit scenarios measured (:mod:`.checker_limits`), e.g. the most attempts of a
    #: group running at once, seconds until a killed holder's slot was free, the rate.
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        """Every safety column is zero, and it was measured: a skipped scenario or a run the
        harness aborted is not safe (nothing, or not everything, was checked)."""
        if self.skipped or self.error or self.runs == 0:
            return False
        return all(getattr(self, name) == 0 for name in SAFETY_COLUMNS)

    @property
    def violated(self) -> bool:
        """A safety column is not zero."""
        return any(getattr(self, name) != 0 for name in SAFETY_COLUMNS)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["safe"] = self.safe
        return out


def _epoch(at: dt.datetime) -> float:
    if at.tzinfo is None:  # SQLite hands back naive datetimes: they were written in UTC
        at = at.replace(tzinfo=dt.timezone.utc)
    return at.timestamp()


def parse_ledger(raw: Iterable[bytes | str]) -> dict[str, list[dict[str, Any]]]:
    """Ledger entries grouped by logical key, in the order they were appended."""
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item in raw:
        entry = json.loads(item)
        by_key[str(entry["key"])].append(entry)
    return by_key


def check(
    result: ScenarioResult,
    jobs: Sequence[Job],
    store: Store,
    ledger: Mapping[str, list[dict[str, Any]]],
    provider_stats: Mapping[str, Any],
) -> ScenarioResult:
    """Fill the safety columns of ``result`` from the history of ``jobs``."""
    by_idem: Mapping[str, Any] = provider_stats.get("by_key", {})
    for job in jobs:
        history = store.transitions.history(job.key)
        events = ledger.get(job.key, [])
        record = store.get(job.key)
        result.stale_refused += sum(
            1 for e in events if e["ev"] == "outcome" and e.get("outcome") == "stale"
        )
        result.stale_writes += _stale_writes(job.key, history, events, store, result.violations)
        result.stale_app_writes += _stale_app_writes(
            job.key, history, events, store, result.violations
        )
        result.generations_claimed_twice += _claimed_twice(
            job.key, history, events, result.violations
        )
        result.duplicate_completions += _duplicate_completions(
            job.key, history, events, result.violations
        )
        if job.extra_completions:
            result.duplicate_completions += job.extra_completions
            result.violations.append(
                f"duplicate completion: {job.key} completed {1 + job.extra_completions} times "
                "under keys of their own"
            )
        result.reruns_after_completion += _reruns(job.key, history, events, result.violations)
        result.duplicate_external_effects += _duplicate_effects(
            job.key, events, store, by_idem, result.violations
        )
        if not job.finished or record is None or record.status not in ("completed", "dead"):
            result.lost_jobs += 1
            result.violations.append(
                f"lost: {job.key} status={record.status if record else None} "
                f"messages finished={job.finished}"
                + (f" generations claimed={job.claims}" if job.claims is not None else "")
            )
        elif record.status == "completed" and any(
            row.status != "delivered" for row in store.outbox_rows.rows(key=job.key)
        ):
            result.lost_jobs += 1
            result.violations.append(f"lost: {job.key} has a committed effect never delivered")
        result.unexpected_outcomes += _unexpected(
            job, record, history, events, by_idem, result.violations
        )
    return result


# -- the witness: what each attempt tried and was told (the ledger), against the store ----------


def _starts(events: Sequence[Mapping[str, Any]]) -> list[tuple[int, float, str]]:
    """(own generation, time, attempt id) of every body start: the store registered that
    generation for that attempt just before."""
    return [
        (int(e["gen"]), float(e["t"]), str(e.get("attempt")))
        for e in events
        if e["ev"] == "start" and e.get("gen") is not None
    ]


def _told(events: Sequence[Mapping[str, Any]], *outcomes: str) -> list[Mapping[str, Any]]:
    """The ledger's ``outcome`` entries: what the store answered each attempt."""
    return [
        e
        for e in events
        if e["ev"] == "outcome" and e.get("outcome") in outcomes and e.get("gen") is not None
    ]


def _witness_stale(
    key: str, events: Sequence[Mapping[str, Any]], violations: list[str]
) -> set[str]:
    """Attempts the store told "completed" (or "dead") although a newer generation had been
    registered for the key and started its body. A terminal write refuses every later
    registration, so a newer start recorded before the answer means the newer registration
    came first: the write was stale whatever the row the store returned said. (A newer start
    recorded after the answer is a registration over a finished job: a re-run, not this.) Each
    as ``attempt id:action``."""
    starts = _starts(events)
    found: set[str] = set()
    for e in _told(events, "completed", "dead"):
        newer = [
            g
            for g, at, a in starts
            if g > int(e["gen"]) and a != e.get("attempt") and at < float(e["t"])
        ]
        if newer:
            found.add(f"{e.get('attempt')}:{e['outcome']}")
            violations.append(
                f"stale write (ledger): {key} attempt {str(e.get('attempt'))[:12]} of generation "
                f"{e['gen']} was told its {e['outcome']} write was accepted although generation "
                f"{max(newer)} had registered and started"
            )
    return found


def _claims(history: Sequence[Transition]) -> list[tuple[int, int, float]]:
    """(position, generation, time) of every accepted registration."""
    return [
        (i, t.generation, _epoch(t.at))
        for i, t in enumerate(history)
        if t.action == "claimed" and t.generation is not None
    ]


def _orphan_effects(
    key: str, history: Sequence[Transition], store: Store, violations: list[str]
) -> int:
    """Outbox rows not written by an accepted completion: a row is written in the completion's
    own statement or transaction, with the same time as its ``completed`` transition."""
    done = [_epoch(t.at) for t in history if t.action == "completed"]
    count = 0
    for row in store.outbox_rows.rows(key=key):
        created = _epoch(row.created_at)
        if not any(abs(created - at) < 0.002 for at in done):
            count += 1
            violations.append(
                f"stale write: {key} outbox row {row.name!r} was not written by an accepted "
                "completion (no completed transition at its time)"
            )
    return count


def _stale_writes(
    key: str,
    history: Sequence[Transition],
    events: Sequence[Mapping[str, Any]],
    store: Store,
    violations: list[str],
) -> int:
    """Each stale write once: a write is named by its attempt and action (``attempt:completed``,
    ``attempt:effect``), so the witness and the store's history finding the same write count it
    once; an outbox row no accepted completion wrote is a write of its own."""
    claims = _claims(history)
    found = _witness_stale(key, events, violations)
    terminal = None
    for i, t in enumerate(history):
        if t.action not in FENCED_WRITES or t.generation is None:
            continue
        write = f"{t.attempt_id}:{t.action}" if t.attempt_id else f"row {i}"
        if terminal is not None:
            if write not in found:
                found.add(write)
                violations.append(
                    f"stale write: {key} {t.action} (row generation {t.generation}) accepted "
                    f"after the job was {terminal.action} by generation {terminal.generation}"
                )
            continue
        if t.action in ("completed", "dead"):
            terminal = t
        newer = [g for pos, g, _ in claims if pos < i and g > t.generation]
        if newer and write not in found:
            found.add(write)
            violations.append(
                f"stale write: {key} {t.action} from generation {t.generation} accepted after "
                f"generation {max(newer)} was registered"
            )
    for e in events:
        if e["ev"] != "effect" or e.get("gen") is None:
            continue
        newer = [g for _, g, at in claims if g > e["gen"] and at < e["t0"]]
        write = f"{e.get('attempt')}:effect:{e['t0']}"
        if newer and write not in found:
            found.add(write)
            violations.append(
                f"stale effect: {key} side effect of generation {e['gen']} started after "
                f"generation {max(newer)} was registered"
            )
    return len(found) + _orphan_effects(key, history, store, violations)


def _stale_app_writes(
    key: str,
    history: Sequence[Transition],
    events: Sequence[Mapping[str, Any]],
    store: Store,
    violations: list[str],
) -> int:
    """App-table writes of generation g that committed although a g' > g was registered first:
    from the store's history (the row's time just before its INSERT, after the ``claimed``
    transition of g'), and from the witness (the block's commit began after g' had started)."""
    claims = _claims(history)
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(APP_ROWS.c.generation, APP_ROWS.c.attempt_id, APP_ROWS.c.written_at).where(
                APP_ROWS.c.key == key
            )
        ).all()
    stale: set[str] = set()
    for generation, attempt_id, written_at in rows:
        newer = [g for _, g, at in claims if g > generation and at < written_at]
        if newer:
            stale.add(str(attempt_id))
            violations.append(
                f"stale app-table write: {key} row of generation {generation} written "
                f"{written_at - min(at for _, g, at in claims if g in newer):.3f}s after "
                f"generation {max(newer)} was registered"
            )
    starts = _starts(events)
    for e in events:
        if e["ev"] not in ("tx_committed", "beside_committed"):
            continue
        if e.get("gen") is None or e.get("t0") is None:
            continue
        newer = [g for g, t, a in starts if g > int(e["gen"]) and t < float(e["t0"])]
        if newer and str(e.get("attempt")) not in stale:
            stale.add(str(e.get("attempt")))
            what = (
                f"the block of generation {e['gen']}"
                if e["ev"] == "tx_committed"
                else f"a write of generation {e['gen']} beside its block ({e.get('form')})"
            )
            violations.append(
                f"stale app-table write (ledger): {key} {what} committed although generation "
                f"{max(newer)} had registered and started before its commit began"
            )
    return len(stale)


def _claimed_twice(
    key: str,
    history: Sequence[Transition],
    events: Sequence[Mapping[str, Any]],
    violations: list[str],
) -> int:
    """One generation registered for two attempts: by the ledger (two bodies started with the
    same generation) or by the store's history (two ``claimed`` rows of one generation)."""
    owners: dict[int, set[str]] = defaultdict(set)
    for g, _, attempt in _starts(events):
        owners[g].add(attempt)
    for t in history:
        if t.action == "claimed" and t.generation is not None and t.attempt_id:
            owners[t.generation].add(t.attempt_id)
    count = 0
    for g, attempts in sorted(owners.items()):
        if len(attempts) > 1:
            count += len(attempts) - 1
            violations.append(
                f"generation claimed twice: {key} generation {g} registered for "
                f"{len(attempts)} attempts ({', '.join(sorted(a[:12] for a in attempts))})"
            )
    return count


def _first_completion(history: Sequence[Transition]) -> Transition | None:
    return next((t for t in history if t.action == "completed"), None)


def _duplicate_completions(
    key: str,
    history: Sequence[Transition],
    events: Sequence[Mapping[str, Any]],
    violations: list[str],
) -> int:
    """Completions beyond the first: the store's ``completed`` rows, or the attempts the store
    told "completed" (the witness), whichever shows more."""
    completions = [t for t in history if t.action == "completed"]
    told = {str(e.get("attempt")) for e in _told(events, "completed")}
    if len(completions) > 1:
        violations.append(
            f"duplicate completion: {key} completed {len(completions)} times "
            f"(generations {[t.generation for t in completions]})"
        )
    if len(told) > 1:
        violations.append(
            f"duplicate completion (ledger): {key} {len(told)} attempts were told their "
            "completion was accepted"
        )
    return max(0, len(completions) - 1, len(told) - 1)


def _reruns(
    key: str,
    history: Sequence[Transition],
    events: Sequence[Mapping[str, Any]],
    violations: list[str],
) -> int:
    first = _first_completion(history)
    if first is None:
        return 0
    done_at = _epoch(first.at)
    late = [e for e in events if e["ev"] == "start" and e["t"] > done_at]
    for e in late:
        violations.append(
            f"re-run after completion: {key} body started (generation {e['gen']}) "
            f"{e['t'] - done_at:.3f}s after generation {first.generation} completed"
        )
    return len(late)


def _duplicate_effects(
    key: str,
    events: Sequence[Mapping[str, Any]],
    store: Store,
    by_idem: Mapping[str, Any],
    violations: list[str],
) -> int:
    """External effects performed more than once for one (logical key, effect name)."""
    idems: dict[str, set[str]] = defaultdict(set)
    for e in events:
        if e["ev"] == "call" and e.get("idem"):
            idems[str(e["effect"])].add(str(e["idem"]))
    rows = store.outbox_rows.rows(key=key)
    names = [row.name for row in rows]
    count = 0
    for name in set(names):
        if names.count(name) > 1:
            count += names.count(name) - 1
            violations.append(f"duplicate outbox rows: {key} {name} x{names.count(name)}")
    for row in rows:
        idems[row.name].add(row.idempotency_key)
    for name, keys in idems.items():
        performed = sum(int(by_idem.get(k, {}).get("performed", 0)) for k in keys)
        if performed > 1:
            count += performed - 1
            violations.append(
                f"duplicate external effect: {key} {name} performed {performed} times at the "
                f"provider (idempotency keys: {len(keys)})"
            )
    return count


def _unexpected(
    job: Job,
    record: Any,
    history: Sequence[Transition],
    events: Sequence[Mapping[str, Any]],
    by_idem: Mapping[str, Any],
    violations: list[str],
) -> int:
    problems = list(job.observed)
    if record is None or record.status not in ("completed", "dead"):
        for p in problems:
            violations.append(f"unexpected outcome: {job.key} {p}")
        return 1 if problems else 0  # the job itself is counted as lost
    if record.status != job.expect:
        problems.append(f"status {record.status}, expected {job.expect}")
    if job.expect_attempts is not None and record.attempts != job.expect_attempts:
        problems.append(f"attempts {record.attempts}, expected {job.expect_attempts}")
    starts = sum(1 for e in events if e["ev"] == "start")
    if job.expect_starts is not None and starts != job.expect_starts:
        problems.append(f"body starts {starts}, expected {job.expect_starts}")
    if not history:
        problems.append("no transition rows: the store's history is missing, nothing was checked")
    if record.status == "completed" and (
        not isinstance(record.result, dict) or record.result.get("generation") != record.generation
    ):
        problems.append("stored result is not the stored generation's")
    if record.status == "completed":
        told = {str(e.get("attempt")) for e in _told(events, "completed")}
        started = {a for _, _, a in _starts(events)}
        if not told:
            problems.append("no attempt recorded that the store accepted its completion")
        elif record.attempt_id not in told:
            problems.append(
                f"the stored attempt {record.attempt_id[:12]} is not the one the store told "
                f"completed ({', '.join(sorted(a[:12] for a in told))})"
            )
        if record.attempt_id not in started:
            problems.append(f"the stored attempt {record.attempt_id[:12]} never started a body")
        for value in job.results:
            if value != record.result:
                problems.append("a caller got a result that is not the stored one")
                break
    if record.status == "completed" and "FAILURE" in job.states:
        problems.append(f"a message ended FAILURE although the job completed ({job.states})")
    if job.expect_reason is not None:
        terminal = next((t for t in history if t.action == record.status), None)
        reason = terminal.reason if terminal is not None else None
        if reason != job.expect_reason:
            problems.append(f"{record.status}, reason {reason!r}, expected {job.expect_reason!r}")
    if job.expect_claims is not None and job.claims != job.expect_claims:
        problems.append(f"{job.claims} generations claimed, expected {job.expect_claims}")
    if job.expect_remote:
        idem = idempotency_key(job.key, CHARGE)
        stats = by_idem.get(idem, {})
        if stats.get("performed") != 1 or int(stats.get("requests", 0)) < 2:
            problems.append(
                f"charge performed {stats.get('performed', 0)} times for "
                f"{stats.get('requests', 0)} requests (expected once, replayed on retry)"
            )
    for p in problems:
        violations.append(f"unexpected outcome: {job.key} {p}")
    return 1 if problems else 0


def render(results: Sequence[ScenarioResult]) -> str:
    """One plain-text table (also valid Markdown)."""
    headers = [h for _, h in COLUMNS]
    rows = []
    for r in results:
        row = []
        for name, _ in COLUMNS:
            value = getattr(r, name)
            if r.skipped and name not in ("scenario",):
                value = "skipped" if name == "runs" else "-"
            elif name == "max_converge_s":
                value = f"{value:.2f}"
            row.append(str(value))
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
            + " |"
        )
    return "\n".join(lines)
