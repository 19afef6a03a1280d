"""Every process a test or harness starts, and how it is stopped: Celery workers and Redis servers.

One module for the pytest plugin, the project's acceptance tests, the chaos harness, the bench and
the demo. Each child runs in its own session (``start_new_session``), so its process group is its
pid: SIGSTOP/SIGCONT/SIGKILL reach a worker's main process and its prefork children together, and
:meth:`Worker.stop` leaves nothing behind. Every child is also registered here, so
:func:`cleanup` (run at interpreter exit, and on SIGINT/SIGTERM once :func:`install_handlers` was
called) kills the groups a caller forgot. Nothing is ever killed by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

_children: list[subprocess.Popen[bytes]] = []
_closers: list[Callable[[], None]] = []
_lock = threading.RLock()  # re-entrant: a signal handler may interrupt a holder
_handlers_installed = False


class WaitTimeout(AssertionError, TimeoutError):
    """A bounded wait ran out (an ``AssertionError`` in a test, a ``TimeoutError`` elsewhere)."""


# -- the registry ----------------------------------------------------------------------------------


def register(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc``'s process group in :func:`cleanup` unless it already ended."""
    with _lock:
        _children[:] = [p for p in _children if p.poll() is None]
        _children.append(proc)


def register_closer(fn: Callable[[], None]) -> None:
    """Run ``fn`` (e.g. stop a proxy or drop a database) in :func:`cleanup`."""
    with _lock:
        _closers.append(fn)


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pid`` (a child started by this module); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def group_alive(pid: int) -> bool:
    """True while any process of group ``pid`` exists (zombies of our own children excluded)."""
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def cleanup() -> None:
    """Kill every process group started here that is still registered, then run the closers."""
    with _lock:
        children, _children[:] = list(_children), []
        closers, _closers[:] = list(reversed(_closers)), []
    for proc in children:
        kill_group(proc.pid, signal.SIGCONT)  # a stopped process does not die of SIGTERM
        kill_group(proc.pid, signal.SIGKILL)
    for proc in children:
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)
    for fn in closers:
        with contextlib.suppress(Exception):
            fn()


atexit.register(cleanup)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    cleanup()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    """SIGINT/SIGTERM handlers that call :func:`cleanup` (for command-line harnesses; pytest
    handles Ctrl-C itself and tears the fixtures down)."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


# -- waiting ---------------------------------------------------------------------------------------


def poll_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` until truthy and return its value; ``None`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            return None
        time.sleep(interval)


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``predicate()`` until truthy and return its value; raise :class:`WaitTimeout` after
    ``timeout`` seconds (every wait is bounded)."""
    assert callable(predicate)
    value = poll_until(predicate, timeout, interval)
    if not value:
        raise WaitTimeout(f"timed out after {timeout}s waiting for {what or predicate}")
    return value


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- Celery workers --------------------------------------------------------------------------------


class Worker:
    """``celery -A <app> worker`` in its own process group: start, pause, resume, kill, stop.

    ``queue`` may be one name or several (``-Q a,b``). The log (stdout and stderr) goes to
    ``log_dir/worker-<name>.log``; :meth:`log` (or :attr:`logs`) reads it.
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

    def wait_ready(self, timeout: float = 60.0) -> Worker:
        """Wait for Celery's `` ready.`` line; a worker that exits or stays silent is stopped and
        the error carries its log."""

        def ready() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited at start:\n{self.log()[-4000:]}")
            return " ready." in self.log()

        if not poll_until(ready, timeout, interval=0.1):
            self.stop()
            raise WaitTimeout(f"worker {self.name} not ready in {timeout}s:\n{self.log()[-4000:]}")
        return self

    def start(self, timeout: float = 60.0) -> Worker:
        """Start the worker and wait until it consumes."""
        return self.launch().wait_ready(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

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


# -- Redis servers ---------------------------------------------------------------------------------


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis at ``url`` answers PING."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        with contextlib.closing(client):
            return bool(client.ping())
    except (redis.RedisError, OSError, ValueError):
        return False


class RedisServer:
    """A throwaway ``redis-server`` on 127.0.0.1:<free port>, without persistence.

    ``args`` are appended to the command line (e.g. ``["--maxmemory", "10mb"]``). :meth:`kill`
    loses everything it held; :meth:`restart` starts it again, empty, on the same port.
    """

    def __init__(
        self, workdir: Path | str, *, port: int | None = None, args: Sequence[str] = ()
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (e.g. apt-get install redis-server); or point the "
                "tests at a running Redis"
            )
        self.binary = binary
        self.port = port or free_port()
        self.dir = Path(workdir) / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def url_for(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.url_for(0)

    @property
    def log_path(self) -> Path:
        return self.dir / "server.log"

    def command(self) -> list[str]:
        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir)]
        return [*cmd, "--save", "", "--appendonly", "no", "--daemonize", "no", *self.args]

    def start(self, timeout: float = 20.0) -> RedisServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        register(self.proc)

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited:\n{self.log()}")
            return self.answers()

        wait_until(answers, timeout, what=f"redis-server on port {self.port}")
        return self

    def answers(self) -> bool:
        """Whether the server answers a PING (subclasses with TLS or Sentinel override it)."""
        return redis_answers(self.url)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: everything it held is gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            kill_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()


@contextlib.contextmanager
def redis_url_or_server(
    url: str, workdir: Path | str, *, own: bool = False
) -> Iterator[tuple[str, RedisServer | None]]:
    """``(url, None)`` when a Redis answers at ``url``; otherwise ``(url of a redis-server
    started here on a free port with the same db, server)``, stopped afterwards."""
    if not own and redis_answers(url):
        yield url, None
        return
    import redis

    db = int(redis.connection.parse_url(url).get("db") or 0)
    server = RedisServer(workdir).start()
    try:
        yield server.url_for(db), server
    finally:
        server.stop()
