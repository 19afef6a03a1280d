"""Metrics seen by a real Prometheus server scraping real workers: a prefork worker's children
aggregate in multiprocess mode, and a pause-and-takeover moves the takeover and stale-refusal
counters."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis

from celery_fence.store import Store
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def sample(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Prometheus:
    def __init__(self, tmp: Path, targets: list[int]) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: celery-fence\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps([f'127.0.0.1:{p}' for p in targets])}\n"
        )
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self.ready, 20, what="prometheus ready")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, expr: str) -> float:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        with urllib.request.urlopen(url, timeout=5) as r:
            result = json.load(r)["data"]["result"]
        return sum(float(item["value"][1]) for item in result)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.log.close()


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
    # Given worker A (prefork, 2 children, multiprocess mode) serving /metrics ...
    a = spawn_worker("a", concurrency=2, FENCE_T_METRICS_PORT=str(port_a))
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
