"""A throwaway PostgreSQL cluster (``initdb`` into a temporary directory, ``postgres`` on a free
loopback port) that a test or the chaos harness can crash (``pg_ctl stop -m immediate``: every
server process quits at once, nothing is flushed, the next start runs crash recovery) and start
again on the same port and data."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from celery_fence.testing.groups import kill_group, read_log, register
from celery_fence.testing.waiting import free_port, wait_until

#: The PostgreSQL binaries this needs, all in one directory.
BINARIES = ("initdb", "pg_ctl", "postgres")
#: The OS user that runs the cluster when this process is root (``initdb`` refuses root).
OS_USER = "postgres"
#: Settings of the cluster: few connections, small buffers, and the WAL writer asleep for 10 s,
#: so an asynchronous commit stays in the WAL buffers (lost by a crash: ``-m immediate`` is a
#: process crash, and what was written to the OS survives it) until a synchronous commit flushes
#: it, a full WAL page wakes the writer, or 10 s pass. No full-page images (the crash cannot tear
#: a page): less WAL per statement, so fewer full pages wake the writer.
DEFAULT_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "max_connections": "60",
    "shared_buffers": "16MB",
    "wal_writer_delay": "10000ms",
    "wal_writer_flush_after": "1GB",
    "synchronous_commit": "on",
    "fsync": "on",
    "full_page_writes": "off",
    "checkpoint_timeout": "30min",
    "log_min_messages": "warning",
}


def postgres_bindir() -> str | None:
    """The directory of ``initdb``, ``pg_ctl`` and ``postgres``: ``pg_config --bindir``, else the
    newest ``/usr/lib/postgresql/*/bin``, else ``PATH``; None when none has all three."""
    candidates: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(out.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(
        versions,
        key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0,
        reverse=True,
    )
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for directory in candidates:
        if all(os.access(os.path.join(directory, b), os.X_OK) for b in BINARIES):
            return directory
    return None


class PostgresCluster:
    """A PostgreSQL cluster of its own: :meth:`start` (``initdb`` the first time), :meth:`crash`
    (``pg_ctl stop -m immediate``), :meth:`start` again (crash recovery), :meth:`stop`,
    :meth:`remove`. Run as root, the server runs as the ``postgres`` OS user (``runuser``), its
    directory chowned to it."""

    def __init__(
        self,
        *,
        port: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError(
                "PostgreSQL's server binaries (initdb, pg_ctl, postgres) were not found "
                "(pg_config --bindir, /usr/lib/postgresql/*/bin, PATH): install them, e.g. "
                "apt-get install postgresql"
            )
        self.bindir = bindir
        self.port = port or free_port()
        # a directory of its own (the server's OS user must reach it: not under a 0700 one)
        self.dir = Path(tempfile.mkdtemp(prefix=f"fence-pg-{self.port}-"))
        self.data = self.dir / "data"
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.crashes = 0

    # -- the URL ----------------------------------------------------------------------------------

    def url(self, driver: str = "psycopg2", database: str = "postgres") -> str:
        return f"postgresql+{driver}://{OS_USER}@127.0.0.1:{self.port}/{database}"

    @property
    def log_path(self) -> Path:
        return self.dir / "server.log"

    def log(self) -> str:
        return read_log(self.log_path)

    # -- running as the postgres OS user -----------------------------------------------------------

    def _as_owner(self, command: Sequence[str]) -> list[str]:
        if os.geteuid() != 0:
            return list(command)
        runuser = shutil.which("runuser")
        if runuser:
            return [runuser, "-u", OS_USER, "--", *command]
        return ["su", OS_USER, "-s", "/bin/sh", "-c", " ".join(_quote(c) for c in command)]

    def _run(self, *command: str, timeout: float = 120.0) -> None:
        proc = subprocess.run(
            self._as_owner(command), capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{os.path.basename(command[0])} exited {proc.returncode}: "
                f"{(proc.stderr or proc.stdout).strip()[-800:]}"
            )

    def _init(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            import pwd

            owner = pwd.getpwnam(OS_USER)
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
        self._run(
            os.path.join(self.bindir, "initdb"),
            "-D",
            str(self.data),
            "-A",
            "trust",
            "-U",
            OS_USER,
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> PostgresCluster:
        """Start the server (``initdb`` first if the cluster has no data yet); after a crash,
        PostgreSQL replays its WAL before it accepts connections."""
        if not (self.data / "PG_VERSION").exists():
            self._init()
        command = [os.path.join(self.bindir, "postgres"), "-D", str(self.data)]
        command += ["-p", str(self.port), "-k", str(self.dir)]
        for name, value in self.settings.items():
            command += ["-c", f"{name}={value}"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._as_owner(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        register(self.proc)

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"postgres on port {self.port} exited:\n{self.log()[-2000:]}")
            return self.answers()

        wait_until(ready, timeout, what=f"postgres on port {self.port}")
        return self

    def answers(self) -> bool:
        import psycopg2

        try:
            conn = psycopg2.connect(
                host="127.0.0.1", port=self.port, user=OS_USER, dbname="postgres", connect_timeout=2
            )
        except psycopg2.Error:
            return False
        conn.close()
        return True

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def crash(self, timeout: float = 30.0) -> None:
        """``pg_ctl stop -m immediate``: every server process quits without flushing anything
        (what is in the WAL buffers and not yet written is lost, as in a crash)."""
        self._run(
            os.path.join(self.bindir, "pg_ctl"),
            "stop",
            "-D",
            str(self.data),
            "-m",
            "immediate",
            "-w",
            "-t",
            str(int(timeout)),
            timeout=timeout + 10,
        )
        if self.proc is not None:
            self.proc.wait(timeout=timeout)
        self.crashes += 1

    def restart_after_crash(self) -> None:
        self.crash()
        self.start()

    def stop(self) -> None:
        """Stop the server (fast shutdown), or kill it if it does not stop."""
        if self.proc is None or self.proc.poll() is not None:
            return
        kill_group(self.proc.pid, signal.SIGINT)  # postgres: fast shutdown
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


__all__ = ["PostgresCluster", "postgres_bindir"]
