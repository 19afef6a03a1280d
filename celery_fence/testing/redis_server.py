"""Throwaway ``redis-server`` processes on a free loopback port, without persistence."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from celery_fence.testing.groups import kill_child, read_log, register, stop_child
from celery_fence.testing.waiting import free_port, wait_until


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
        return read_log(self.log_path)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: everything it held is gone (no persistence)."""
        if self.proc is not None:
            kill_child(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc)

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
