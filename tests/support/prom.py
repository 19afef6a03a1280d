"""Metrics helpers: a free port, a scrape of /metrics, and a real Prometheus server (the Debian
package's ``prometheus`` binary, installed by scripts/services) scraping ports every second."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from tests.support.worker import wait_until


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
