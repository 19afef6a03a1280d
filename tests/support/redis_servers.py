"""Throwaway loopback Redis servers for topology tests: plain, TLS, Cluster and Sentinel.

Every server is a real ``redis-server`` process on a free loopback port, in its own session and
working directory, without persistence; :meth:`RedisServer.stop` (or the context managers here)
leaves nothing behind. Tests skip, with the reason, only when a binary is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from celery_fence.testing import processes
from celery_fence.testing.processes import free_port
from tests.support.worker import Worker, app_worker, wait_until

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


def missing_binaries(*names: str) -> str | None:
    """The skip reason when one of ``names`` (redis-server, redis-cli, openssl) is missing."""
    paths = {"redis-server": REDIS_SERVER, "redis-cli": REDIS_CLI, "openssl": OPENSSL}
    for name in names:
        if not os.access(paths[name], os.X_OK):
            return f"{name} is not installed (looked for {paths[name]})"
    return None


class RedisServer(processes.RedisServer):
    """One ``redis-server`` process on 127.0.0.1 (TCP, or TLS with ``tls``; a cluster node; a
    sentinel): the project's one process module's server with the topology's command line."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        tls: TlsFiles | None = None,
        sentinel_conf: str | None = None,
        cluster: bool = False,
    ) -> None:
        super().__init__(workdir, port=port or free_port(cluster_bus=cluster), args=args)
        self.tls = tls
        self.cluster = cluster
        self.sentinel_conf = sentinel_conf

    def command(self) -> list[str]:
        if self.sentinel_conf is not None:
            conf = self.dir / "sentinel.conf"
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\n{self.sentinel_conf}")
            return [REDIS_SERVER, str(conf), "--sentinel", "--dir", str(self.dir)]
        cmd = [REDIS_SERVER, "--bind", "127.0.0.1", "--dir", str(self.dir)]
        cmd += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.tls is not None:
            cmd += ["--port", "0", "--tls-port", str(self.port)]
            cmd += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
            cmd += ["--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "optional"]
        else:
            cmd += ["--port", str(self.port)]
        if self.cluster:
            cmd += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.dir / "nodes.conf"),
            ]
            cmd += ["--cluster-node-timeout", "2000"]
        return cmd + self.args

    def start(self, timeout: float = 20.0) -> RedisServer:
        super().start(timeout)
        return self

    def answers(self) -> bool:
        try:
            with contextlib.closing(self.client()) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain client straight to this server (not through fence settings)."""
        options: dict[str, object] = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        if self.tls is not None:
            options.update(ssl=True, ssl_ca_certs=str(self.tls.ca), ssl_cert_reqs="required")
        options.update(kwargs)
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"


@contextlib.contextmanager
def servers(*items: RedisServer) -> Iterator[tuple[RedisServer, ...]]:
    """Start ``items`` in order; stop every one of them afterwards, whatever happened."""
    try:
        for s in items:
            s.start()
        yield items
    finally:
        for s in items:
            s.stop()


# -- TLS ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_self_signed(workdir: Path) -> TlsFiles:
    """A self-signed certificate for 127.0.0.1/localhost (it is its own CA), made with openssl."""
    workdir.mkdir(parents=True, exist_ok=True)
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(
        [
            OPENSSL,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return TlsFiles(ca=cert, cert=cert, key=key)


# -- Redis Cluster --------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[list[RedisServer]]:
    """``masters`` cluster-enabled servers joined by ``redis-cli --cluster create``."""
    nodes = [RedisServer(workdir, cluster=True) for _ in range(masters)]
    with servers(*nodes):
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

        def converged() -> bool:
            for n in nodes:
                with contextlib.closing(n.client()) as c:
                    if c.cluster("INFO").get("cluster_state") != "ok":
                        return False
            return True

        wait_until(converged, 30, interval=0.1, what="cluster_state:ok on every node")
        yield nodes


def begin_slot_migration(source: RedisServer, target: RedisServer, slot: int) -> tuple[str, str]:
    """Put ``slot`` half-way: MIGRATING on the source, IMPORTING on the target. Returns the ids."""
    with contextlib.closing(source.client()) as src, contextlib.closing(target.client()) as dst:
        src_id = _text(src.execute_command("CLUSTER MYID"))
        dst_id = _text(dst.execute_command("CLUSTER MYID"))
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    return src_id, dst_id


def move_keys(source: RedisServer, target: RedisServer, slot: int, keys: Sequence[str]) -> None:
    """``MIGRATE`` the given keys of ``slot`` from ``source`` to ``target`` (slot half-way)."""
    with contextlib.closing(source.client()) as src:
        for key in keys:
            src.execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)


def finish_slot_migration(nodes: Sequence[RedisServer], target: RedisServer, slot: int) -> None:
    """Move every remaining key of ``slot`` to ``target`` and assign the slot to it everywhere."""
    with contextlib.closing(target.client()) as dst:
        dst_id = _text(dst.execute_command("CLUSTER MYID"))
    for node in nodes:
        if node is target:
            continue
        with contextlib.closing(node.client()) as src:
            _migrate_all(src, slot, target.port)
    for node in nodes:
        with contextlib.closing(node.client()) as c:
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)


def _migrate_all(src: redis.Redis, slot: int, port: int) -> None:
    """MIGRATE every key ``src`` still holds in ``slot`` to 127.0.0.1:``port``."""
    while True:
        keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
        if not keys:
            return
        for key in keys:
            src.execute_command("MIGRATE", "127.0.0.1", port, key, 0, 5000)


def node_for_slot(nodes: Sequence[RedisServer], slot: int) -> RedisServer:
    with contextlib.closing(nodes[0].client()) as c:
        for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                port = int(primary[1])
                return next(n for n in nodes if n.port == port)
    raise LookupError(f"slot {slot} is not served")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- Sentinel -------------------------------------------------------------------------------------


@dataclass
class SentinelSet:
    master: RedisServer
    replica: RedisServer
    sentinel: RedisServer
    name: str

    @property
    def url(self) -> str:
        """Celery's broker URL form for this sentinel: ``sentinel://host:port``."""
        return f"sentinel://127.0.0.1:{self.sentinel.port}"

    def current_master_port(self) -> int:
        with contextlib.closing(self.sentinel.client()) as c:
            _host, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.name)
        return int(port)


@contextlib.contextmanager
def sentinel_set(workdir: Path, name: str = "fencemaster") -> Iterator[SentinelSet]:
    """A master, one replica of it and one sentinel (quorum 1, fast failure detection)."""
    master = RedisServer(workdir)
    replica = RedisServer(workdir)
    replica.args = ["--replicaof", "127.0.0.1", str(master.port)]
    sentinel = RedisServer(
        workdir,
        sentinel_conf=(
            f"sentinel monitor {name} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {name} 600\n"
            f"sentinel failover-timeout {name} 3000\n"
            f"sentinel parallel-syncs {name} 1\n"
        ),
    )
    with servers(master, replica):

        def replica_synced() -> bool:
            with contextlib.closing(replica.client()) as c:
                return c.info("replication").get("master_link_status") == "up"

        wait_until(replica_synced, 30, interval=0.1, what="replica in sync with the master")
        with servers(sentinel):
            s = SentinelSet(master=master, replica=replica, sentinel=sentinel, name=name)

            def sees_replica() -> bool:
                with contextlib.closing(sentinel.client()) as c:
                    return bool(c.execute_command("SENTINEL REPLICAS", name))

            wait_until(sees_replica, 30, interval=0.1, what="sentinel discovers the replica")
            yield s


def wait_for_replication(master: RedisServer, timeout_ms: int = 5000) -> None:
    """Block until every connected replica acknowledged the master's writes so far."""
    with contextlib.closing(master.client(socket_timeout=timeout_ms / 1000 + 2)) as c:
        c.execute_command("WAIT", 1, timeout_ms)


# -- workers whose fence Redis is one of these servers --------------------------------------------


def topology_worker(
    log_dir: Path, worker_env: dict[str, str], name: str, *, concurrency: int = 1, **env: str
) -> Worker:
    """A (not yet started) worker running tests/support/topology_app.py with ``env`` added."""
    import uuid

    return app_worker(
        "tests.support.topology_app",
        env={**worker_env, **env},
        queue=worker_env["FENCE_T_QUEUE"],
        name=f"{name}-{uuid.uuid4().hex[:6]}",
        log_dir=log_dir,
        concurrency=concurrency,
    )
