"""The failure windows again, with ``fence_defer_first_registration=True``: a first claim writes
its row only with its outcome (one statement for a completion), and every invariant holds.

The scenarios are the ones of the default design, collected here a second time with the workers'
setting turned on (the module's ``worker_env`` below), so both designs face the same windows.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_fence.store import Store
from tests.acceptance.test_core_failure_windows import (  # noqa: F401 - collected again here
    test_pause_timeline_stale_attempt_loses,
    test_sigkill_after_commit_before_ack_replays_without_rerunning_the_body,
    test_two_workers_given_the_same_key_at_once_one_body_run_no_message_lost,
)
from tests.acceptance.test_retries import (  # noqa: F401 - collected again here
    test_success_after_two_transient_failures_completes_on_the_third_attempt,
)
from tests.acceptance.test_settle_edges import _broker_drained, _ended, _runs

pytestmark = pytest.mark.acceptance


@pytest.fixture
def worker_env(worker_env: dict[str, str]) -> dict[str, str]:
    return {**worker_env, "FENCE_T_DEFER": "1"}


def test_a_first_completion_is_one_row_with_its_claim_and_completion(
    spawn_worker: Any,
    client_app: Any,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    key = f"defer:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key)
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation, record.attempts) == ("completed", 1, 1)
    assert [t.action for t in fence_store.history(key)] == ["claimed", "completed"]
    assert record.request is not None and record.request["args"] == [key]


def test_a_first_attempt_that_kills_its_worker_is_counted_when_the_next_registers(
    spawn_worker: Any,
    client_app: Any,
    redis_client: Any,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a message that SIGKILLs its worker on every run, two attempts allowed: the first
    # (generation 1) dies before writing any row
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="2")
    key = f"defer-poison:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key, fail="kill")
    # Then generation 2 registers counting both executions, dies too, and generation 3 finds
    # the attempts spent: dead, after two body runs, attempts == 2, the message acked
    record = _ended(fence_store, key, timeout=90)
    assert (record.status, record.attempts) == ("dead", 2)
    assert _runs(redis_client, prefix, key) == 2
    assert fence_store.history(key)[-1].reason == "attempts exhausted"
    _broker_drained(client_app)
