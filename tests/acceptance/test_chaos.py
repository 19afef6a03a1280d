"""The chaos suite as users run it: ``python -m celery_fence.chaos`` in a subprocess, read back
through its ``--json`` output.

A short run of every scenario must inject its faults and keep every safety column at zero; the
same scenarios with one mechanism switched off (the store's generation fence, the
registration's terminal-state term, the provider's idempotency) must fire the columns that
mechanism keeps at zero (so the zeros are its doing); Celery's own exits (time-limit, expires,
misconfig, refused-arg, interrupted) left unsettled (``--unsettled``) must lose the jobs the same
run, settled, with the same seed and converge timeout, keeps (so those zeros are the settle
step's doing, not the timeout's); Ctrl-C must leave no worker behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from celery_fence.chaos import BESIDE_FORMS
from celery_fence.chaos.checker import SAFETY_COLUMNS
from celery_fence.chaos.options import SCENARIOS
from tests.support.env import BROKER_URL, PG_ADMIN_URL, REDIS_URL
from tests.support.leftovers import kill_groups, processes_mentioning
from tests.support.worker import ROOT, wait_until

pytestmark = pytest.mark.acceptance

RUNS = 2
MAX_ATTEMPTS = 3
#: The fewest faults each scenario injects in RUNS runs (see celery_fence.chaos's docstring).
MIN_FAULTS = {
    "pause": RUNS,
    "app-write": RUNS,
    "orm-binds": RUNS,
    "django-write": RUNS,
    "beside-block": RUNS,
    "atomic-threads": RUNS,
    "kill": 3 * RUNS,
    "duplicate": 3 * RUNS,
    "redis-loss": RUNS,
    "db-outage": RUNS,
    "unknown-remote": RUNS,
    "poison": (1 + MAX_ATTEMPTS) * RUNS,
    "time-limit": (1 + MAX_ATTEMPTS) * RUNS,
    "expires": 2 * RUNS,
    "misconfig": RUNS,
    "refused-arg": RUNS,
    "recovered-chain": RUNS,
    "interrupted": RUNS,
    "enqueue-crash": RUNS,
    "broker-loss": 100 * RUNS,
    "store-crash": 2 * RUNS,
    "steps": RUNS,
    "export": RUNS,
    "unique": RUNS,
    "beat": 2 * RUNS,
    "group": 2 * RUNS,
    "rate": RUNS,
}
#: The converge timeout of both runs of the unsettled comparison: twice what the settled run
#: needs (time-limit and misconfig up to about 10 s of waiting on a loaded machine; 7.7 s the
#: longest under a load of 4-8 on 2 cores); a lost job is known lost only when it runs out, so
#: the unsettled run waits it out once per scenario.
UNSETTLED_TIMEOUT = "20"
#: Celery's own exits, and the jobs each run loses when Celery's own exits are left unsettled.
UNSETTLED_LOSSES = {
    "time-limit": 2,
    "expires": 2,
    "misconfig": 3,
    "refused-arg": 1,
    "interrupted": 1,
    "recovered-chain": 1,  # under --unsettled the harness re-sends the step bare: b is lost
    # the control arm of the enqueue scenarios: plain .delay() after the commit
    "enqueue-crash": 3,
    "broker-loss": 100,
}


def _command(tmp_path: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery_fence.chaos",
        "--redis-url",
        REDIS_URL,
        "--broker-url",
        BROKER_URL,
        "--pg-admin-url",
        PG_ADMIN_URL,
        "--ttl",
        "1.5",
        "--max-attempts",
        str(MAX_ATTEMPTS),
        "--converge-timeout",
        "60",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(tmp_path / "chaos.json"),
        *args,
    ]


def _chaos(tmp_path: Path, *args: str, timeout: float = 900) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        _command(tmp_path, *args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    path = tmp_path / "chaos.json"
    assert path.exists(), f"no JSON written (exit {proc.returncode}):\n{output}"
    return proc.returncode, json.loads(path.read_text()), output


def _by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["scenario"]: s for s in report["scenarios"]}


#: Scenarios with a test of their own (and its control arm) below, not in the halves
#: (beside-block's runs there each text form, a superset of the halves' two runs).
SEPARATE = ("beside-block", "store-crash", "unique", "beat", "group", "rate")
#: Every other scenario, in two halves run side by side (each half is one harness run).
_HALVED = [name for name in SCENARIOS if name not in SEPARATE]
HALVES = {
    "windows": _HALVED[: len(_HALVED) // 2],
    "exits": _HALVED[len(_HALVED) // 2 :],
}


def test_the_halves_are_every_scenario() -> None:
    halves = HALVES["windows"] + HALVES["exits"] + list(SEPARATE)
    assert sorted(halves) == sorted(MIN_FAULTS) == sorted(SCENARIOS)


@pytest.mark.slow(210, by_param={"windows": 160})
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("half", sorted(HALVES))
def test_every_scenario_injects_its_faults_and_every_safety_column_is_zero(
    tmp_path: Path, half: str
) -> None:
    # Given every scenario, a few runs each, against real workers, Redis, SQLite and PostgreSQL,
    names = HALVES[half]
    code, report, output = _chaos(
        tmp_path, "--scenario", ",".join(names), "--runs", str(RUNS), "--seed", "7"
    )
    scenarios = _by_name(report)
    # then every scenario ran and really injected its faults (db-outage on PostgreSQL) ...
    assert set(scenarios) == set(names), output
    for name in names:
        minimum = MIN_FAULTS[name]
        row = scenarios[name]
        assert row["skipped"] is None, (name, row["skipped"])
        assert row["runs"] == RUNS, (name, output)
        assert row["faults"] >= minimum, (name, row, output)
        assert row["max_converge_s"] < 60, (name, row)
    # ... and the history shows no stale write, lost job, duplicate, or re-run after completion.
    for name, row in scenarios.items():
        assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), (
            name,
            row["violations"],
        )
    assert code == 0 and report["ok"] is True, output
    assert "every safety column is zero" in output


@pytest.mark.slow(35)
@pytest.mark.timeout(600)
def test_pause_on_postgresql_keeps_the_fence(tmp_path: Path, pg_url: str) -> None:
    # Given the pause scenario with the store on PostgreSQL (the production store),
    code, report, output = _chaos(
        tmp_path, "--scenario", "pause", "--runs", "4", "--database-url", pg_url
    )
    row = _by_name(report)["pause"]
    # then all four body variants (guarded or not, with or without an outbox effect) are rejected.
    assert row["faults"] == 4
    assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), row
    assert code == 0, output


@pytest.mark.timeout(600)
def test_app_write_on_postgresql_keeps_the_fence(tmp_path: Path, pg_url: str) -> None:
    # Given a worker paused inside its fence.transaction() block, the store on PostgreSQL,
    code, report, output = _chaos(
        tmp_path, "--scenario", "app-write", "--runs", str(RUNS), "--database-url", pg_url
    )
    row = _by_name(report)["app-write"]
    # then its row never lands (the server ended its idle block) and nothing else goes wrong.
    assert row["faults"] == RUNS
    assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), row
    assert code == 0, output


#: The control arms: one mechanism switched off per arm, everything else as in the fenced run
#: above (same seed, TTL, attempts and converge timeout); the scenarios each arm runs, and the
#: safety columns it must fire. ``lost jobs`` fires in the unsettled arm below; beside-block's
#: arm (``--unwatched``) is its own test below, in every text form; atomic-threads' fenced run is
#: in the "windows" half above.
ARMS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "--unfenced": (
        "pause,app-write,orm-binds,django-write,atomic-threads,redis-loss",
        {
            "atomic-threads": ("stale_app_writes",),
            "pause": ("stale_writes", "duplicate_completions", "unexpected_outcomes"),
            "app-write": ("stale_app_writes",),
            "orm-binds": ("stale_app_writes",),
            "django-write": ("stale_app_writes",),
            "redis-loss": ("generations_claimed_twice",),
        },
    ),
    "--rerun-finished": (
        "kill",
        {"kill": ("reruns_after_completion", "duplicate_completions")},
    ),
    "--unfenced-steps": (
        "steps,export",
        {"steps": ("stale_writes", "unexpected_outcomes"), "export": ("unexpected_outcomes",)},
    ),
    "--provider-not-idempotent": (
        "unknown-remote",
        {"unknown-remote": ("duplicate_external_effects", "unexpected_outcomes")},
    ),
}


@pytest.mark.slow(15, by_param={"--unfenced": 80, "--unfenced-steps": 45})
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arm", list(ARMS))
def test_each_control_arm_fires_its_safety_columns(tmp_path: Path, arm: str) -> None:
    # Given the fenced run's scenarios, seed and timeouts with one mechanism switched off (the
    # store's generation fence, the registration's terminal-state term, or the provider's
    # idempotency),
    scenarios, fires = ARMS[arm]
    code, report, output = _chaos(
        tmp_path, "--scenario", scenarios, "--runs", str(RUNS), "--seed", "7", arm
    )
    rows = _by_name(report)
    # then each scenario fires the columns that mechanism keeps at zero, and the harness fails.
    for name, columns in fires.items():
        row = rows[name]
        assert row["runs"] == RUNS and row["skipped"] is None, (name, row, output)
        for column in columns:
            assert row[column] > 0, (name, column, row["violations"])
    assert code == 1 and report["ok"] is False, output


@pytest.mark.slow(28)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arm", ["fenced", "--unwatched"])
def test_a_write_beside_a_block_is_refused_in_every_text_form(tmp_path: Path, arm: str) -> None:
    # Given a worker paused inside its fenced block, whose body then writes on another
    # connection in each text form of issue 31 item 1 (a leading comment, WITH + newline, a
    # writing function, CALL, DO, SELECT INTO: one form per run), with the fence's write watcher
    # on, or off (the control arm),
    runs = str(len(BESIDE_FORMS))
    args = ["--scenario", "beside-block", "--runs", runs, "--seed", "7", "--ttl", "1.0"]
    code, report, output = _chaos(tmp_path, *args, *([] if arm == "fenced" else [arm]))
    row = _by_name(report)["beside-block"]
    assert row["runs"] == len(BESIDE_FORMS) and row["skipped"] is None, (row, output)
    assert row["faults"] == len(BESIDE_FORMS), row
    if arm == "fenced":
        # then each of those writes is refused at its COMMIT, whatever its text,
        assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), row
        assert code == 0, output
        return
    # and unwatched, the paused attempt's write lands in every form: a stale app-table write.
    assert row["stale_app_writes"] == len(BESIDE_FORMS), row["violations"]
    for form in BESIDE_FORMS:
        assert any(f"beside its block ({form})" in v for v in row["violations"]), (form, row)
    assert code == 1, output


def test_the_arms_together_fire_every_safety_column() -> None:
    fired = {c for _, fires in ARMS.values() for columns in fires.values() for c in columns}
    # lost_jobs: the unsettled test below; limits_broken: the group and rate tests below
    assert fired | {"lost_jobs", "limits_broken"} == set(SAFETY_COLUMNS)


#: The unsettled comparison in two groups run side by side: Celery's own exits, and the
#: enqueue scenarios (whose control arm is plain ``.delay()``).
UNSETTLED_GROUPS = {
    "celery-exits": [n for n in UNSETTLED_LOSSES if not n.startswith(("enqueue", "broker"))],
    "enqueue": [n for n in UNSETTLED_LOSSES if n.startswith(("enqueue", "broker"))],
}


@pytest.mark.slow(190, by_param={"enqueue": 70})
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", sorted(UNSETTLED_GROUPS))
def test_unsettled_exits_lose_the_jobs_the_settled_run_keeps(tmp_path: Path, group: str) -> None:
    # Given Celery's own exits (hard time limit, expires on a retry and on a busy reschedule, a
    # misconfigured worker, an argument PostgreSQL refuses, a cancelled body; and a chain's lost
    # step re-sent without its workflow), one run each, run twice with the same seed and
    # converge timeout: settled, then with Celery's own exits handled as plain Celery handles
    # them (--unsettled),
    names = UNSETTLED_GROUPS[group]
    args = ["--scenario", ",".join(names), "--runs", "1", "--seed", "7"]
    args += ["--converge-timeout", UNSETTLED_TIMEOUT]
    (tmp_path / "settled").mkdir()
    (tmp_path / "unsettled").mkdir()
    settled_code, settled, settled_output = _chaos(tmp_path / "settled", *args)
    code, report, output = _chaos(tmp_path / "unsettled", *args, "--unsettled")
    # then the settled run loses nothing within that timeout, so the timeout is not what loses
    # a job ...
    assert report["unsettled"] is True and settled["unsettled"] is False
    for name in names:
        row = _by_name(settled)[name]
        assert row["runs"] == 1 and row["faults"] > 0, (name, row, settled_output)
        assert row["lost_jobs"] == 0, (name, row["violations"])
    assert settled_code == 0, settled_output
    # ... and the unsettled one loses its jobs in every window (a row left running or retrying
    # with no message, or no row at all); the harness fails.
    for name in names:
        lost = UNSETTLED_LOSSES[name]
        row = _by_name(report)[name]
        assert row["skipped"] is None and row["runs"] == 1, (name, row, output)
        assert row["faults"] > 0, (name, row)
        assert row["lost_jobs"] == lost, (name, row["violations"])
    assert code == 1 and report["ok"] is False, output


@pytest.mark.timeout(600)
def test_store_crash_loses_nothing(
    tmp_path: Path,
) -> None:
    # Given the harness's own PostgreSQL cluster crashed (pg_ctl stop -m immediate) after a
    # block's commit, between a completion's commit and its ack, after a registration, inside a
    # block, and while recovery re-sends enqueued jobs, then restarted: one run, fenced,
    (tmp_path / "fenced").mkdir()
    args = ["--scenario", "store-crash", "--runs", "1", "--seed", "7"]
    code, report, output = _chaos(tmp_path / "fenced", *args)
    row = _by_name(report)["store-crash"]
    # then both crashes happened and every job converged once: no stale write, no lost job, no
    # double completion (the registrations the crash lost cost a re-run, nothing else) ...
    assert row["skipped"] is None and row["runs"] == 1 and row["faults"] == 2, (row, output)
    assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), (
        row["violations"],
        output,
    )
    assert code == 0, output
    # ... the completion committed before the crash was there after it (its job: 1 attempt) ...
    assert "crash in after_commit: completed g1 attempts 1 before, completed g1" in output, output


@pytest.mark.timeout(600)
def test_store_crash_with_asynchronous_endings_loses_a_job(tmp_path: Path) -> None:
    # With the endings committed as the registration is, without their WAL flush, the job whose
    # completion was acked before the crash is lost: the scenario catches it. (The arm's workers
    # run no recovery checks of their own, which would re-run that job and hide the loss.)
    (tmp_path / "arm").mkdir()
    args = ["--scenario", "store-crash", "--runs", "1", "--seed", "7"]
    arm_args = [*args, "--converge-timeout", "10", "--async-endings"]
    code, report, output = _chaos(tmp_path / "arm", *arm_args)
    row = _by_name(report)["store-crash"]
    assert row["runs"] == 1 and row["faults"] == 2, (row, output)
    # the acked completion was gone after the restart (the arm starts that job last, so no
    # later job's WAL makes it durable) ...
    assert "crash in after_commit: completed g1 attempts 1 before, running g1" in output, output
    # ... so the job ran again: a second attempt told its completion counted, or another result
    # stored than the one its caller was given (whichever the checker meets first)
    rerun = [v for v in row["violations"] if ":after_commit " in v]
    caught = ("a caller got a result that is not the stored one", "duplicate completion")
    assert any(c in v for v in rerun for c in caught), (row["violations"], output)
    assert row["unexpected_outcomes"] + row["duplicate_completions"] >= 1
    assert code == 1 and report["ok"] is False, output


#: Issue 36's scenarios: (runs of the fenced run, its control arm, the columns the arm fires).
#: unique's two runs are its two deaths (SIGKILL, hard time limit); its arm's one run the SIGKILL.
ISSUE_36 = {
    "unique": (2, "--ttl-lock", ("lost_jobs", "unexpected_outcomes")),
    "beat": (1, "--stock-beat", ("duplicate_completions",)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arm", ["fenced", "control"])
@pytest.mark.parametrize("scenario", sorted(ISSUE_36))
def test_unique_jobs_and_beat_replicas_hold_and_their_control_arms_fail(
    tmp_path: Path, scenario: str, arm: str
) -> None:
    runs, control, fires = ISSUE_36[scenario]
    if arm == "fenced":
        # Given a unique job's holder killed (SIGKILL of its worker; a hard time limit), or
        # three beat replicas with one SIGKILLed as a tick starts and the lease Redis restarted,
        args = ["--scenario", scenario, "--runs", str(runs), "--seed", "7"]
        code, report, output = _chaos(tmp_path, *args, timeout=280)
        row = _by_name(report)[scenario]
        # then every later send ran within the bound and every tick ran once: all zeros.
        assert row["runs"] == runs and row["skipped"] is None, (row, output)
        assert row["faults"] >= MIN_FAULTS[scenario] // RUNS * runs, (row, output)
        assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), (
            row["violations"],
            output,
        )
        assert code == 0, output
        return
    # Given the same faults under what users migrate from (a celery-once-style TTL lock; three
    # stock Celery beats),
    args = ["--scenario", scenario, "--runs", "1", "--seed", "7", control]
    code, report, output = _chaos(tmp_path, *args, timeout=280)
    row = _by_name(report)[scenario]
    assert row["runs"] == 1 and row["skipped"] is None, (row, output)
    # then the checker reports it: the later sends discarded by the stranded lock (lost), or
    # each tick completed about once per replica (duplicates).
    for column in fires:
        assert row[column] > 0, (column, row["violations"])
    if scenario == "unique":
        assert any("the lock still held" in v for v in row["violations"]), row["violations"]
    else:
        assert row["duplicate_completions"] >= 4, row["violations"]  # about 2 a second
    assert code == 1 and report["ok"] is False, output


@pytest.mark.timeout(120)
def test_unique_on_rabbitmq_a_killed_holder_s_job_runs_again_within_a_ttl_of_its_lease_s_end(
    tmp_path: Path,
) -> None:
    # Given the unique scenario's SIGKILL run on RabbitMQ, which gives the dead worker's message
    # back at once (it meets the holder's lease: a busy reschedule),
    args = ["--scenario", "unique", "--runs", "1", "--seed", "7", "--broker", "amqp"]
    code, report, output = _chaos(tmp_path, *args, timeout=110)
    row = _by_name(report)["unique"]
    # then the job ran again within one TTL of its lease's end and two of the kill (the
    # scenario's own bounds), and every later send ran: all safety columns zero.
    assert row["runs"] == 1 and row["faults"] == 1, (row, output)
    assert "SIGKILL, ran again" in output and "after the lease's end" in output, output
    assert {c: row[c] for c in SAFETY_COLUMNS} == dict.fromkeys(SAFETY_COLUMNS, 0), (
        row["violations"],
        output,
    )
    assert code == 0, output


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arm", ["fenced", "--no-group-limit"])
def test_a_group_of_limit_3_never_runs_more_than_3_and_killed_slots_come_back(
    tmp_path: Path, arm: str
) -> None:
    # Given 8 worker processes (2 workers -c 4), 24 jobs of one group with fence_group_limit=3,
    # and two SIGKILLs of processes holding a slot, or (the control arm) the same group with no
    # fence_group_limit: only Celery's per-worker concurrency,
    args = ["--scenario", "group", "--runs", "1", "--seed", "7"]
    code, report, output = _chaos(tmp_path, *args, *([] if arm == "fenced" else [arm]))
    row = _by_name(report)["group"]
    measured = row["measured"]
    assert row["runs"] == 1 and row["faults"] == 2 and measured["kills"] == 2, (row, output)
    assert measured["samples"] > 50, measured  # the running set was sampled all along
    columns = {c: row[c] for c in SAFETY_COLUMNS}
    if arm == "fenced":
        # then never more than 3 ran at once (the ledger's spans and the samples), each killed
        # holder's slot was free again within one TTL of its SIGKILL, and every job completed
        # once (the killed ones on a later attempt): nothing lost, nothing run twice.
        assert measured["max_running_ledger"] <= 3 and measured["max_running_sampled"] <= 3
        assert measured["max_running_ledger"] == 3, measured  # the limit was reached
        assert len(measured["slot_back_s"]) == 2, measured
        assert max(measured["slot_back_s"]) <= measured["ttl"] + 0.25, measured
        assert columns == dict.fromkeys(SAFETY_COLUMNS, 0), (row["violations"], output)
        assert code == 0, output
        return
    # and without the fence's limit, more than 3 ran at once: the checker reports it.
    assert measured["max_running_ledger"] > 3, measured
    assert row["limits_broken"] >= 1, row["violations"]
    assert any("group limit broken" in v for v in row["violations"]), row["violations"]
    assert {c: v for c, v in columns.items() if c != "limits_broken"} == dict.fromkeys(
        set(SAFETY_COLUMNS) - {"limits_broken"}, 0
    ), row["violations"]
    assert code == 1, output


#: Seconds the rate scenario measures over: a minute for the fence (the issue's measure), less
#: for the control arm (3 workers x Celery's per-worker limit shows in 20 s).
RATE_DURATIONS = {"fenced": 60, "--celery-rate-limit": 20}


@pytest.mark.slow(80, by_param={"--celery-rate-limit": 30})
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arm", list(RATE_DURATIONS))
def test_a_rate_limit_holds_across_workers_over_a_minute_with_a_kill(
    tmp_path: Path, arm: str
) -> None:
    # Given three workers, fence_rate_limit="2/s" shared by them, more jobs queued than the
    # window takes, and the process running one of them SIGKILLed mid-window, or (the control
    # arm) Celery's own rate_limit="2/s", which each worker applies on its own,
    duration = RATE_DURATIONS[arm]
    args = ["--scenario", "rate", "--runs", "1", "--seed", "7", "--duration", str(duration)]
    code, report, output = _chaos(tmp_path, *args, *([] if arm == "fenced" else [arm]))
    row = _by_name(report)["rate"]
    measured = row["measured"]
    assert row["runs"] == 1 and row["faults"] == 1, (row, output)
    assert measured["duration_s"] == duration and measured["workers"] == 3, measured
    (error,) = measured["relative_error"]
    assert not measured["notes"], measured  # the queue never ran dry inside the window
    columns = {c: row[c] for c in SAFETY_COLUMNS}
    if arm == "fenced":
        # then the bodies started within 10 % of 2/s over the whole minute, and every job
        # completed once (the killed one on a later attempt).
        assert abs(error) <= 0.10, measured
        assert columns == dict.fromkeys(SAFETY_COLUMNS, 0), (row["violations"], output)
        assert code == 0, output
        return
    # and with Celery's per-worker limit, the three workers together ran well above it.
    assert error > 1.0, measured  # about 3x the target: 2/s a worker
    assert row["limits_broken"] == 1, row["violations"]
    assert {c: v for c, v in columns.items() if c != "limits_broken"} == dict.fromkeys(
        set(SAFETY_COLUMNS) - {"limits_broken"}, 0
    ), row["violations"]
    assert code == 1, output


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_process_the_harness_started(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.Popen(
        _command(tmp_path, "--scenario", "pause", "--runs", "50"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # Given the harness running, with its workers up (their names carry the run id),
        def ready_worker_names() -> list[str]:
            logs = list(work.glob("worker-*.log")) if work.exists() else []
            return [p.stem[len("worker-") :] for p in logs if " ready." in p.read_text()]

        wait_until(lambda: len(ready_worker_names()) >= 2, 120, what="the chaos workers")
        run_id = ready_worker_names()[0].rsplit("-", 1)[1]
        assert processes_mentioning(run_id), "the workers should be running"
        time.sleep(1.0)  # mid-scenario
        # when it is interrupted (Ctrl-C),
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        # then no process it started is left.
        wait_until(lambda: not processes_mentioning(run_id), 20, what="the workers to be gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # On a failure above, the harness never stopped its workers (each in a process group of
        # its own); each names this test's directory in its environment.
        kill_groups(processes_mentioning(str(tmp_path)))
