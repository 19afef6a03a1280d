"""Real Celery worker processes for acceptance tests: start, pause, resume, kill, stop.

Each worker runs in its own process group (``start_new_session``), so SIGSTOP/SIGKILL reach the
main process and its prefork children together, and :meth:`Worker.stop` leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    def __init__(
        self,
        app: str,
        *,
        env: Mapping[str, str],
        queue: str,
        name: str,
        log_dir: Path,
        concurrency: int = 1,
        pool: str = "prefork",
        loglevel: str = "INFO",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.queue = queue
        self.name = name
        self.log_path = log_dir / f"worker-{name}.log"
        self.concurrency = concurrency
        self.pool = pool
        self.loglevel = loglevel
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Worker:
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app,
            "worker",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            "-n",
            f"{self.name}@%h",
            "-Q",
            self.queue,
            "-l",
            self.loglevel,
            "--prefetch-multiplier=1",
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
            *self.extra_args,
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            env=self.env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited at start:\n{self.log()}")
            if " ready." in self.log():
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"worker {self.name} not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the whole worker: main process and pool children."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole worker (no warm or cold shutdown, nothing acked)."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGCONT)
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout=10)
        # prefork children that outlived the main process
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(Exception):
            self._log.close()


@contextlib.contextmanager
def running(*workers: Worker) -> Iterator[tuple[Worker, ...]]:
    try:
        for w in workers:
            w.start()
        yield workers
    finally:
        for w in workers:
            w.stop()


def wait_until(predicate: object, timeout: float, interval: float = 0.05, what: str = "") -> None:
    """Poll ``predicate()`` until truthy; fail after ``timeout`` seconds (every wait is bounded)."""
    assert callable(predicate)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
