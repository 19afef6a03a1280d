"""Metrics seen by a real Prometheus server scraping real workers: a prefork worker's children
aggregate in multiprocess mode, and a pause-and-takeover moves the takeover and stale-refusal
counters."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis

from celery_fence.store import Store
from tests.support import ledger
from tests.support.prom import Prometheus, free_port, sample, scrape
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prometheus_bin() -> None:
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: run scripts/bootstrap (it installs it)")


@pytest.fixture
def prometheus_servers(tmp_path: Path) -> Iterator[list[Prometheus]]:
    started: list[Prometheus] = []
    yield started
    for p in started:
        p.stop()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_prometheus_sees_a_takeover_and_the_stale_completion_refused(
    prometheus_bin: None,
    prometheus_servers: list[Prometheus],
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    tmp_path: Path,
) -> None:
    port_a, port_b = free_port(), free_port()
    prom = Prometheus(tmp_path, [port_a, port_b])
    prometheus_servers.append(prom)
    # Given worker A (prefork, 2 children, multiprocess mode) serving /metrics, and a sender
    # whose settings say metrics are on (its messages carry their publish time: the queue wait)
    a = spawn_worker("a", concurrency=2, FENCE_T_METRICS_PORT=str(port_a))
    client_app.app.conf.fence_metrics = True
    # ... whose two children each run a job at once: its /metrics sums both children.
    warm = [client_app.work.delay(f"warm:{uuid.uuid4().hex[:8]}", sleep=1.0) for _ in range(2)]
    for r in warm:
        r.get(timeout=20)
    text = scrape(port_a)
    assert sample(text, "celery_fence_claims_total") == 2
    assert sample(text, "celery_fence_completions_total") == 2
    assert sample(text, "celery_fence_attempt_duration_seconds_count") == 2
    assert sample(text, "celery_fence_queue_wait_seconds_count") == 2
    wait_until(lambda: prom.query("sum(celery_fence_claims_total)") == 2, 20, what="scraped")
    # When A runs a job and is paused (SIGSTOP) past its lease TTL (2 s) inside the body ...
    key = f"report:{uuid.uuid4().hex[:8]}"
    store = Store(db_url)
    first = client_app.work.delay(key, sleep=4.0, check=False)
    wait_until(
        lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 20, what="A starts the body"
    )
    a.pause()
    time.sleep(2.6)
    # ... worker B (threads pool: in-process registry) takes the job over,
    b = spawn_worker("b", pool="threads", FENCE_T_METRICS_PORT=str(port_b))
    second = client_app.work.delay(key)
    assert second.get(timeout=20)["generation"] == 2
    # and A resumes: its completion is refused (it never checked its lease).
    a.resume()
    assert first.get(timeout=30) == second.get(timeout=1)
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 2)
    store.dispose()
    # Then Prometheus saw B's takeover (with its time) and A's refused completion.
    query = prom.query
    wait_until(
        lambda: (
            query("sum(celery_fence_takeovers_total)") == 1
            and query('sum(celery_fence_stale_refusals_total{where="completion"})') == 1
        ),
        30,
        what="prometheus sees the takeover and the stale refusal",
    )
    assert query("sum(celery_fence_takeover_seconds_count)") == 1
    assert query("sum(celery_fence_takeover_seconds_sum)") >= 2.0  # A's lease ran out first
    assert query('sum(celery_fence_lease_renewal_seconds_count{job="celery-fence"})') > 0
    b.stop()
    a.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_solo_worker_counts_in_process_and_a_replay_is_no_takeover(
    spawn_worker: SpawnWorker, client_app: ModuleType, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a solo worker (no multiprocess directory: its own registry) serving /metrics,
    port = free_port()
    spawn_worker("solo", pool="solo", FENCE_T_METRICS_PORT=str(port))
    key = f"once:{uuid.uuid4().hex[:8]}"
    # when one key is sent twice (the second delivery replays the stored result),
    first = client_app.work.delay(key).get(timeout=20)
    assert client_app.work.delay(key).get(timeout=20) == first
    # and one job fails once (a retry, then completed) and another for good (dead),
    flaky, doomed = f"flaky:{uuid.uuid4().hex[:8]}", f"doomed:{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}:fail_times:{flaky}", 1)
    client_app.work.delay(flaky, fail="transient").get(timeout=30)
    with pytest.raises(Exception, match="simulated permanent failure"):
        client_app.work.delay(doomed, fail="permanent").get(timeout=30)
    # then it counted each: claims, completions, the replay, the retry by its reason class, the
    # dead job, and no takeover (a replay or a retry is none).
    text = scrape(port)
    assert sample(text, "celery_fence_claims_total") == 5
    assert sample(text, "celery_fence_completions_total") == 2
    assert sample(text, "celery_fence_replays_total") == 1
    assert (
        sample(text, 'celery_fence_retries_total{reason="error",task="tests.support.app.work"}')
        == 1
    )
    assert sample(text, "celery_fence_retries_total") == 1
    assert sample(text, "celery_fence_dead_jobs_total") == 1
    assert sample(text, "celery_fence_takeovers_total") == 0
    assert sample(text, "celery_fence_commit_seconds_count") == 2  # the completions


def test_the_shipped_rules_pass_promtool_and_the_dashboard_names_real_metrics(
    prometheus_bin: None,
) -> None:
    rules = ROOT / "docs" / "prometheus" / "celery-fence-rules.yml"
    out = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    from celery_fence.metrics import families
    from celery_fence.ops import metrics as store

    known = {
        *(families.PREFIX + n + "_total" for n, _ in families.TRANSITION_COUNTERS.values()),
        *(
            families.PREFIX + n + "_total"
            for n in (
                "stale_refusals",
                "takeovers",
                "retries",
                "outbox_deliveries",
                "outbox_failures",
                "outbox_dead_effects",
            )
        ),
        *(
            families.PREFIX + h + suffix
            for h in (
                "queue_wait_seconds",
                "attempt_duration_seconds",
                "lease_renewal_seconds",
                "commit_seconds",
                "takeover_seconds",
            )
            for suffix in ("_bucket", "_count", "_sum")
        ),
        *(
            store.P + g
            for g in (
                "jobs",
                "stuck_jobs",
                "outbox_effects",
                "outbox_oldest_pending_age_seconds",
                "store_up",
            )
        ),
    }
    import re

    dashboard = json.loads((ROOT / "docs" / "grafana" / "celery-fence.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs
    named = {m for e in exprs for m in re.findall(r"celery_fence_[a-z_]+", e)}
    assert named and named <= known, named - known
    rule_text = rules.read_text()
    in_rules = set(re.findall(r"celery_fence_[a-z_]+", rule_text))
    assert in_rules and in_rules <= known, in_rules - known
