"""Celery workers and beat replicas as child processes, each in its own process group:
``celery -A <app> worker``, ``celery -A <app> beat``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from celery_fence.testing.groups import kill_child, kill_group, read_log, register, stop_child
from celery_fence.testing.waiting import WaitTimeout, poll_until


class Worker:
    """``celery -A <app> worker`` in its own process group: start, pause, resume, kill, stop.

    The one worker process class: the pytest plugin, the chaos harness and the project's own
    tests (and the bench and the demo) each pass their app (``-A``), environment, pool and
    concurrency.

    ``queue`` may be one name or several (``-Q a,b``). The log (stdout and stderr) goes to
    ``log_dir/worker-<name>.log``; :meth:`log` (or :attr:`logs`) reads it. ``cwd`` and
    ``pythonpath`` (the ``PYTHONPATH`` the worker imports the app from; default: inherited) say
    where ``-A`` is found. ``ready_timeout`` bounds :meth:`wait_ready` and :meth:`start`.
    :meth:`launch` starts the process without waiting, for a caller that starts several workers
    at once or watches the start itself (:attr:`exited`, :meth:`log`).
    """

    def __init__(
        self,
        app: str,
        *,
        env: Mapping[str, str],
        queue: str | Sequence[str],
        name: str,
        log_dir: Path,
        concurrency: int = 1,
        pool: str = "prefork",
        loglevel: str = "INFO",
        extra_args: Sequence[str] = (),
        cwd: Path | str | None = None,
        pythonpath: Sequence[str] | None = None,
        prefetch_multiplier: int | None = 1,
        ready_timeout: float = 60.0,
    ) -> None:
        self.app = app
        self.queues = [queue] if isinstance(queue, str) else list(queue)
        self.name = name
        self.log_path = Path(log_dir) / f"worker-{name}.log"
        self.concurrency = concurrency
        self.pool = pool
        self.loglevel = loglevel
        self.extra_args = tuple(extra_args)
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        env = {**os.environ, **env}
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        self.env = env
        self.prefetch_multiplier = prefetch_multiplier
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def queue(self) -> str:
        return self.queues[0]

    @property
    def hostname_pattern(self) -> str:
        return f"{self.name}@%h"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "celery", "-A", self.app, "worker"]
        cmd += ["-P", self.pool, "-c", str(self.concurrency), "-n", self.hostname_pattern]
        cmd += ["-Q", ",".join(self.queues), "-l", self.loglevel]
        if self.prefetch_multiplier is not None:
            cmd.append(f"--prefetch-multiplier={self.prefetch_multiplier}")
        cmd += ["--without-heartbeat", "--without-mingle", "--without-gossip"]
        return cmd + list(self.extra_args)

    def launch(self) -> Worker:
        """Start the process without waiting for it (see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        register(self.proc)
        return self

    def wait_ready(self, timeout: float | None = None) -> Worker:
        """Wait (at most ``timeout`` s, default :attr:`ready_timeout`) for Celery's `` ready.``
        line; a worker that exits or stays silent is stopped and the error carries its log."""
        timeout = self.ready_timeout if timeout is None else timeout

        def ready() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited at start:\n{self.log()[-4000:]}")
            return " ready." in self.log()

        if not poll_until(ready, timeout, interval=0.1):
            self.stop()
            raise WaitTimeout(f"worker {self.name} not ready in {timeout}s:\n{self.log()[-4000:]}")
        return self

    def start(self, timeout: float | None = None) -> Worker:
        """Start the worker and wait until it consumes."""
        return self.launch().wait_ready(timeout)

    def log(self) -> str:
        return read_log(self.log_path)

    @property
    def logs(self) -> str:
        """Everything the worker printed so far."""
        return self.log()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the worker was not started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exited(self) -> bool:
        """True once the launched main process ended (e.g. a worker that refused to start)."""
        return self.proc is not None and self.proc.poll() is not None

    def owns(self, pid: int) -> bool:
        """True when process ``pid`` (e.g. a pool child) belongs to this worker's group."""
        if self.proc is None:
            return False
        try:
            return os.getpgid(pid) == self.proc.pid
        except ProcessLookupError:
            return False

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole group: the main process and its pool children."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the whole worker: main process and pool children (its leases stop renewing)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole worker (no warm or cold shutdown, nothing acked)."""
        if self.proc is None:
            return
        kill_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM) within ``timeout``, then SIGKILL whatever is left of the
        group: prefork children that outlived the main process too."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            kill_group(self.proc.pid, signal.SIGCONT)  # a stopped worker does not hear SIGTERM
            kill_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        kill_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class BeatReplica:
    """One ``celery -A <app> beat`` process in its own process group (SIGKILL kills it all):
    ``fenced`` runs ``-S celery_fence.beat:Scheduler``, else Celery's stock scheduler with its
    own schedule file. The one beat process class: the chaos harness's beat scenario and the
    project's beat tests.

    ``env`` is the whole environment of the process; its log (stdout and stderr) goes to
    ``log_dir/beat-<name>.log``, its stock schedule file beside it; ``cwd`` is where ``-A`` is
    imported from (with ``env``'s ``PYTHONPATH``)."""

    def __init__(
        self,
        app: str,
        *,
        env: Mapping[str, str],
        name: str,
        log_dir: Path,
        fenced: bool = True,
        cwd: Path | str | None = None,
    ) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", app, "beat", "-l", "INFO"]
        cmd += ["-s", str(Path(log_dir) / f"{name}-schedule"), "--pidfile="]
        if fenced:
            cmd += ["-S", "celery_fence.beat:Scheduler"]
        self.log_path = Path(log_dir) / f"beat-{name}.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        register(self.proc)

    def log(self) -> str:
        return read_log(self.log_path)

    def kill(self) -> None:
        """SIGKILL the whole replica (mid-tick: nothing of its pass is finished)."""
        kill_child(self.proc)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        stop_child(self.proc)


@contextlib.contextmanager
def running(*workers: Worker) -> Iterator[tuple[Worker, ...]]:
    """Start ``workers`` (all launched first, then waited for); stop every one afterwards."""
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        yield workers
    finally:
        for w in workers:
            w.stop()
