"""The seed's failure windows with real worker processes and real signals (issue: core).

Every test asserts on stored state and on the ledger of what the workload really did.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from celery_fence.store import Store
from tests.support.worker import wait_until

pytestmark = pytest.mark.acceptance


def _runs(redis_client: Any, prefix: str, key: str) -> list[str]:
    return [v.decode() for v in redis_client.lrange(f"{prefix}:runs:{key}", 0, -1)]


def _effects(redis_client: Any, prefix: str, key: str) -> list[str]:
    return [v.decode() for v in redis_client.lrange(f"{prefix}:effects:{key}", 0, -1)]


@pytest.mark.parametrize("checks", [True, False], ids=["checks", "does-not-check"])
def test_pause_timeline_stale_attempt_loses(
    spawn_worker: Any,
    client_app: Any,
    redis_client: Any,
    prefix: str,
    db_url: str,
    checks: bool,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    store = Store(db_url)
    # Given worker A running the job (generation 1) ...
    a = spawn_worker("a")
    first = client_app.work.delay(key, sleep=4.0, check=checks)
    wait_until(lambda: len(_runs(redis_client, prefix, key)) == 1, 20, what="A starts the body")
    # ... when A pauses past its TTL (2 s) and B takes a second message for the same key,
    a.pause()
    time.sleep(2.6)
    b = spawn_worker("b")
    second = client_app.work.delay(key)
    assert second.get(timeout=20)["generation"] == 2
    # then A resumes: its check() raises, or, if it never checks, the store rejects it.
    a.resume()
    assert first.get(timeout=30) == second.get(timeout=1)  # both callers converge
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation) == ("completed", 2)
    assert record.result["generation"] == 2
    runs = _runs(redis_client, prefix, key)
    assert [r.split(":")[0] for r in runs[:2]] == ["1", "2"]
    effects = _effects(redis_client, prefix, key)
    if checks:
        assert effects == [runs[1]]  # the stale attempt started no side effect
    else:
        assert runs[0] in effects  # it did (it never checked) ...
    actions = [(t.action, t.generation) for t in store.history(key)]
    assert ("stale", 1) in actions or ("lost", 1) in actions
    assert ("completed", 2) in actions and ("completed", 1) not in actions
    b.stop()
