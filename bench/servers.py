"""Servers the benchmark owns: throwaway ``redis-server`` and PostgreSQL instances on free ports.

Counting from the servers (Redis ``INFO commandstats``, PostgreSQL ``pg_stat_statements``) only
means something when nothing else talks to them, so the bench starts its own: one Redis for the
leases (and python-redis-lock's locks), one Redis as the Celery broker, and one PostgreSQL cluster
with ``pg_stat_statements`` preloaded. Each lives in its own temporary directory, without
persistence for Redis, and is stopped (and its directory removed) by :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from celery_fence.testing import processes
from celery_fence.testing.processes import free_port


def wait_for(predicate: object, timeout: float, what: str) -> None:
    """Poll ``predicate()`` until truthy; raise after ``timeout`` seconds."""
    assert callable(predicate)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class PrivateRedis(processes.RedisServer):
    """One ``redis-server`` on 127.0.0.1:<free port>, no persistence, in a directory of its own
    (the project's one process module, :mod:`celery_fence.testing.processes`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(tempfile.mkdtemp(prefix=f"fence-bench-{name}-"))

    def start(self, timeout: float = 20.0) -> PrivateRedis:
        super().start(timeout)
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir.parent, ignore_errors=True)


def postgres_bindir() -> Path | None:
    """The directory holding ``initdb``/``pg_ctl`` (newest version found), or None."""
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=False)
        bindir = Path(out.stdout.strip())
        if (bindir / "initdb").exists():
            return bindir
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class PrivatePostgres:
    """A throwaway PostgreSQL cluster with ``pg_stat_statements`` preloaded (trust auth).

    PostgreSQL refuses to run as root: as root, ``initdb`` and ``pg_ctl`` run as the ``postgres``
    system user through ``runuser``.
    """

    def __init__(self) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found")
        self.bindir = bindir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fence-bench-pg-"))
        self.data = self.dir / "data"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self.started = False

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self._as, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> PrivatePostgres:
        self._run(
            str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust"
        )
        options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.dir}",
                "-c shared_preload_libraries=pg_stat_statements",
                "-c pg_stat_statements.track=top",
                "-c max_connections=200",
            ]
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "postgres.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        self.started = True
        return self

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.started:
            with contextlib.suppress(Exception):
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "stop")
            self.started = False
        shutil.rmtree(self.dir, ignore_errors=True)
