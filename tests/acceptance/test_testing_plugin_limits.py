"""The plugin's limit faults, as a user meets them (a throwaway project run by a pytest
subprocess, as :mod:`tests.acceptance.test_testing_plugin` does): ``fence_group_full`` and
``fence_rate_limited`` make the user's task meet a real ``group_full`` / ``rate_limited`` (re-sent,
never an attempt, then run once the fault ends), and ``fence_chaos``'s ``kill-slot-holder`` window
SIGKILLs a process holding a group slot: the slot is back within one TTL and the job completes
once. The same window against a task with no group limit fails, naming why."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.acceptance.test_testing_plugin import CONFTEST, _assert_nothing_left, _records, _run
from tests.support.env import BROKER_URL, REDIS_URL

pytestmark = pytest.mark.acceptance

PROJECT = f'''
from celery import Celery

from celery_fence import FencedTask

app = Celery("proj", broker="{BROKER_URL}")
app.conf.update(fence_redis_url="{REDIS_URL}")


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"g:{{n}}", fence_group="tenant",
          fence_group_limit=2)
def grouped(self, n):
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"u:{{n}}", fence_group="tenant")
def unlimited(self, n):
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"r:{{n}}", fence_rate_limit="1/s")
def rated(self, n):
    return {{"n": n}}
'''

TESTS = """
import time

import pytest

from celery_fence.testing.chaos import ConvergenceError
from proj import grouped, rated, unlimited


def _completed(fence_store, key, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = fence_store.get(key)
        if record is not None and record.status == "completed":
            return record
        time.sleep(0.1)
    raise AssertionError(f"{key} did not complete in {timeout}s")


def _reasons(fence_store, key):
    return [t.reason for t in fence_store.transitions.history(key)]


def test_group_full(fence_group_full, fenced_worker, fence_store):
    fenced_worker.start()
    fence_group_full.fill("tenant", 2, hold=30)
    grouped.delay(1)
    deadline = time.monotonic() + 30
    while "group_full" not in _reasons(fence_store, "g:1"):
        assert time.monotonic() < deadline, _reasons(fence_store, "g:1")
        time.sleep(0.1)
    assert fence_store.get("g:1") is None or fence_store.get("g:1").status != "completed"
    fence_group_full.free()
    record = _completed(fence_store, "g:1")
    assert record.attempts == 1  # the re-sends were never attempts


def test_rate_limited(fence_rate_limited, fenced_worker, fence_store):
    fenced_worker.start()
    fence_rate_limited.drain("1/s", seconds=3, task="proj.rated")
    sent = time.monotonic()
    rated.delay(1)
    record = _completed(fence_store, "r:1")
    assert time.monotonic() - sent >= 2.0  # it waited for its token
    assert "rate_limited" in _reasons(fence_store, "r:1")
    assert record.attempts == 1


def test_kill_slot_holder(fence_chaos, fence_env):
    injection = fence_chaos.inject("kill-slot-holder", grouped.s(2))
    assert injection.slot_back_s is not None
    assert injection.slot_back_s <= fence_env.lease_ttl + 0.25
    fence_chaos.assert_converged("g:2")


def test_kill_slot_holder_without_a_limit(fence_chaos):
    fence_chaos.inject("kill-slot-holder", unlimited.s(3))
"""


@pytest.mark.slow(35)
def test_the_limit_faults_reach_a_users_task_and_a_killed_slot_comes_back(tmp_path: Path) -> None:
    # Given a user project with a task of a group limited to 2, one of a group with no limit and
    # one limited to 1/s, and tests using fence_group_full, fence_rate_limited and fence_chaos's
    # kill-slot-holder window,
    root = tmp_path / "user"
    root.mkdir()
    (root / "proj.py").write_text(textwrap.dedent(PROJECT))
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_limits.py").write_text(TESTS)
    # when they run,
    outcomes = _run(root, "-p", "no:celery")
    # then the faults reach the task (re-sent, not attempts, then run), the killed holder's slot
    # is back within one TTL and its job completes once ...
    for name in ("test_group_full", "test_rate_limited", "test_kill_slot_holder"):
        assert outcomes[name] == ("passed", ""), (name, outcomes[name][1][-3000:])
    # ... and the window against a task with no group limit fails, saying why.
    outcome, text = outcomes["test_kill_slot_holder_without_a_limit"]
    assert outcome == "failed", text
    assert "ran holding no group slot: the kill-slot-holder window needs a task" in text, text
    _assert_nothing_left(_records(root))
