"""Every process and socket the harness starts, and how it is stopped.

Each child process runs in its own session (``start_new_session``), so its process group is its
pid: SIGSTOP/SIGCONT/SIGKILL reach a worker's main process and its prefork children together, and
:func:`cleanup` kills every group the harness started — on success, failure, Ctrl-C (SIGINT),
SIGTERM and interpreter exit (atexit). Nothing is ever killed by name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

_children: list[subprocess.Popen[bytes]] = []
_closers: list[Callable[[], None]] = []
_lock = threading.RLock()  # re-entrant: the signal handler may interrupt a holder
_installed = False


def _register(proc: subprocess.Popen[bytes]) -> None:
    with _lock:
        _children.append(proc)


def register_closer(fn: Callable[[], None]) -> None:
    """Run ``fn`` (e.g. stop a proxy or drop a database) in :func:`cleanup`."""
    with _lock:
        _closers.append(fn)


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def cleanup() -> None:
    """Kill every process group the harness started, then run the registered closers."""
    with _lock:
        children, _children[:] = list(_children), []
        closers, _closers[:] = list(reversed(_closers)), []
    for proc in children:
        _kill_group(proc.pid, signal.SIGCONT)  # a stopped process does not die of SIGTERM
        _kill_group(proc.pid, signal.SIGKILL)
    for proc in children:
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)
    for fn in closers:
        with contextlib.suppress(Exception):
            fn()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    cleanup()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    """atexit + SIGINT/SIGTERM handlers that call :func:`cleanup` (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(cleanup)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> bool:
    """Poll ``predicate()`` until truthy; False after ``timeout`` seconds (every wait bounded)."""
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


class Worker:
    """``celery -A celery_fence.chaos.workload worker`` in its own process group."""

    def __init__(self, *, name: str, queue: str, env: Mapping[str, str], log_dir: Path) -> None:
        self.name = name
        self.queue = queue
        self.env = {**os.environ, **env}
        self.log_path = log_dir / f"worker-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_fence.chaos.workload",
            "worker",
            "-P",
            "prefork",
            "-c",
            "1",
            "-n",
            f"{self.name}@%h",
            "-Q",
            self.queue,
            "-l",
            "INFO",
            "--prefetch-multiplier=1",
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        _register(self.proc)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        def ready() -> bool:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited at start; see {self.log_path}")
            return " ready." in self.log()

        if not wait_until(ready, timeout, interval=0.1):
            raise TimeoutError(f"worker {self.name} not ready in {timeout}s; see {self.log_path}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def owns(self, pid: int) -> bool:
        """True when process ``pid`` (e.g. a pool child) belongs to this worker's group."""
        try:
            return os.getpgid(pid) == self.pid
        except ProcessLookupError:
            return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        _kill_group(self.proc.pid, signal.SIGKILL)  # and prefork children that outlived it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class RedisServer:
    """A throwaway ``redis-server`` on a loopback port, without persistence (the lease store)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("--own-redis needs redis-server on PATH")
        self.binary = binary
        self.port = port or free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        import redis

        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir)]
        cmd += ["--save", "", "--appendonly", "no"]
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        _register(self.proc)

        def answers() -> bool:
            try:
                with contextlib.closing(redis.Redis(port=self.port, socket_timeout=1)) as c:
                    return bool(c.ping())
            except redis.RedisError:
                return False

        if not wait_until(answers, timeout):
            raise RuntimeError(f"redis-server on port {self.port} did not start")
        return self

    def kill(self) -> None:
        """SIGKILL: everything it held is gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()


class TcpProxy:
    """A loopback TCP proxy in front of a database: :meth:`down` refuses new connections and cuts
    the open ones (a real outage as the client sees it); :meth:`up` listens again on the same
    port."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        register_closer(self.down)

    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
            with contextlib.suppress(OSError):
                conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    return
                self._conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
