"""The lease store beyond one Redis: TLS, unix socket + ACL, Redis Cluster, Sentinel.

Every test starts its own loopback ``redis-server`` processes on free ports (see
tests/support/redis_servers.py) and stops them afterwards. The SQL store stays the fence: the
tests assert that Redis topology changes (a slot migration, a failover that loses writes) cost at
most a retry, never a generation at or below the store's or a stale write.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_fence.config import FenceConfig
from celery_fence.errors import StaleGeneration
from celery_fence.leases.lease import LeaseStore, make_redis_client
from celery_fence.leases.limits import Limits, Slot, parse_rate
from celery_fence.store import Store
from celery_fence.store.records import Completion
from tests.support import ledger
from tests.support.redis_servers import (
    RedisServer,
    SentinelSet,
    begin_slot_migration,
    finish_slot_migration,
    make_self_signed,
    missing_binaries,
    move_keys,
    node_for_slot,
    redis_cluster,
    sentinel_set,
    servers,
    topology_worker,
    wait_for_replication,
)
from tests.support.worker import wait_until

needs_redis = pytest.mark.skipif(
    bool(missing_binaries("redis-server", "redis-cli")),
    reason=missing_binaries("redis-server", "redis-cli") or "",
)
needs_openssl = pytest.mark.skipif(
    bool(missing_binaries("openssl")), reason=missing_binaries("openssl") or ""
)

TTL_MS = 30_000


def _register(store: Store, key: str, generation: int, attempt_id: str) -> Any:
    return store.register(key, generation=generation, attempt_id=attempt_id, task_name="topo")


def _eventually(fn: Any, timeout: float = 30.0) -> Any:
    """``fn()``'s value once it stops raising connection errors (a failover in progress)."""
    end = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


# -- TLS, unix socket, ACL ------------------------------------------------------------------------


def _exercise(leases: LeaseStore, key: str) -> None:
    """Claim, renew through the batch, release, claim again: the fenced cycle on this server."""
    g1 = leases.claim(key, "a", TTL_MS)
    lease_key = leases.keys_for(key).lease
    assert leases.batch([(lease_key, f"a:{g1}", TTL_MS)], []) == ([True], [])
    assert leases.batch([], [(lease_key, f"a:{g1}")]) == ([], [True])
    assert leases.claim(key, "b", TTL_MS) == g1 + 1


@needs_redis
@needs_openssl
def test_rediss_url_against_a_tls_server_with_a_self_signed_certificate(
    tmp_path: Path, prefix: str
) -> None:
    tls = make_self_signed(tmp_path / "tls")
    with servers(RedisServer(tmp_path, tls=tls)) as (server,):
        base = f"rediss://127.0.0.1:{server.port}/0"
        # Given the CA in the URL query, or in fence_redis_ssl, the lease cycle works over TLS.
        by_url = FenceConfig(redis_url=f"{base}?ssl_cert_reqs=required&ssl_ca_certs={tls.ca}")
        _exercise(LeaseStore(make_redis_client(by_url.redis), prefix=prefix), "tls:url")
        by_setting = FenceConfig(
            redis_url=base, redis_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(tls.ca)}
        )
        _exercise(LeaseStore(make_redis_client(by_setting.redis), prefix=prefix), "tls:setting")
        # The certificate is verified: without the CA the handshake fails (a transient
        # connection error at claim time, so the message would be retried, never run unfenced).
        unverified = LeaseStore(make_redis_client(FenceConfig(redis_url=base).redis), prefix=prefix)
        with pytest.raises(redis.ConnectionError):
            unverified.claim("tls:no-ca", "c", TTL_MS)
        # ... and a plain-text client cannot talk to the TLS port at all.
        plain = FenceConfig(redis_url=f"redis://127.0.0.1:{server.port}/0")
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            LeaseStore(make_redis_client(plain.redis), prefix=prefix).claim(
                "tls:plain", "d", TTL_MS
            )
        with contextlib.closing(server.client()) as direct:
            assert direct.get(f"{prefix}:{{{_tag('tls:no-ca')}}}:gen") is None  # nothing leaked


def _tag(key: str) -> str:
    return LeaseStore(None, prefix="x").keys_for(key).lease.split("{")[1].split("}")[0]


@needs_redis
def test_unix_socket_and_acl_user_in_the_url(tmp_path: Path, prefix: str) -> None:
    sock = tmp_path / "redis.sock"
    server = RedisServer(
        tmp_path,
        args=[
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
        ],
    )
    with servers(server):
        with contextlib.closing(server.client()) as admin:  # an ACL user; the default user off
            admin.acl_setuser(
                "fence", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"]
            )
            admin.acl_setuser("default", enabled=False)
        acl_tcp = FenceConfig(redis_url=f"redis://fence:s3cret@127.0.0.1:{server.port}/0")
        _exercise(LeaseStore(make_redis_client(acl_tcp.redis), prefix=prefix), "acl:tcp")
        acl_unix = FenceConfig(redis_url=f"unix://fence:s3cret@{sock}?db=0")
        _exercise(LeaseStore(make_redis_client(acl_unix.redis), prefix=prefix), "acl:unix")
        wrong = FenceConfig(redis_url=f"redis://fence:wrong@127.0.0.1:{server.port}/0")
        with pytest.raises(redis.AuthenticationError):
            LeaseStore(make_redis_client(wrong.redis), prefix=prefix).claim(
                "acl:wrong", "x", TTL_MS
            )


# -- Redis Cluster --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    reason = missing_binaries("redis-server", "redis-cli")
    if reason:
        pytest.skip(reason)
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes


@pytest.fixture
def cluster_config(cluster: list[RedisServer]) -> FenceConfig:
    # Two of the three masters as startup nodes: the third is discovered.
    return FenceConfig(redis_url=f"{cluster[0].url};{cluster[1].url}", redis_cluster=True)


@pytest.fixture
def cluster_leases(cluster_config: FenceConfig, prefix: str) -> LeaseStore:
    return LeaseStore(make_redis_client(cluster_config.redis), prefix=prefix)


def _evalsha_calls(nodes: list[RedisServer]) -> list[int]:
    out = []
    for n in nodes:
        with contextlib.closing(n.client()) as c:
            out.append(int((c.info("commandstats").get("cmdstat_evalsha") or {}).get("calls", 0)))
    return out


def _slot(leases: LeaseStore, key: str) -> int:
    keys = leases.keys_for(key)
    assert key_slot(keys.lease.encode()) == key_slot(keys.generation.encode())  # one hash tag
    return key_slot(keys.lease.encode())


def test_cluster_fenced_claims_renewals_releases_over_many_keys(
    cluster: list[RedisServer], cluster_leases: LeaseStore, store: Store
) -> None:
    leases = cluster_leases
    keys = [f"job:{i}" for i in range(60)]
    # Given 60 logical keys spread over all three masters,
    owners = {node_for_slot(cluster, _slot(leases, k)).port for k in keys}
    assert owners == {n.port for n in cluster}
    gens = {k: leases.claim(k, f"a{i}", TTL_MS) for i, k in enumerate(keys)}
    assert set(gens.values()) == {1}
    for i, k in enumerate(keys):
        assert _register(store, k, gens[k], f"a{i}").outcome == "registered"
    renewals = [(leases.keys_for(k).lease, f"a{i}:{gens[k]}", TTL_MS) for i, k in enumerate(keys)]
    assert leases.batch(renewals, [])[0] == [True] * 60  # loads renew.lua where missing
    # when the renewer's tick renews all of them, each renewal runs exactly once, on its node
    before = _evalsha_calls(cluster)
    renewed, _ = leases.batch(renewals, [])
    after = _evalsha_calls(cluster)
    assert renewed == [True] * 60
    assert sum(after) - sum(before) == 60
    assert all(a > b for a, b in zip(after, before, strict=True))  # every node had its share
    # A holder whose lease expired learns it on its next renewal and loses authority:
    expired = keys[:5]
    for k in expired:
        lease_key = leases.keys_for(k).lease
        assert leases.batch([], [(lease_key, f"a{keys.index(k)}:1")]) == ([], [True])
        assert leases.claim(k, "short", 50) == 2
    time.sleep(0.2)
    short = [(leases.keys_for(k).lease, "short:2", TTL_MS) for k in expired]
    assert leases.batch(short, [])[0] == [False] * 5
    for k in expired:  # ... and the next claim is fenced above it, in Redis and in the store
        assert leases.claim(k, "next", TTL_MS) == 3
        assert _register(store, k, 3, "next").outcome == "registered"
        with pytest.raises(StaleGeneration):
            store.end(
                k, Completion(generation=1, attempt_id=f"a{keys.index(k)}", result={"late": 1})
            )
        store.end(k, Completion(generation=3, attempt_id="next", result={"ok": 3}))
    # then the remaining holders release in one batch: compare-and-delete, all still theirs.
    rest = [(leases.keys_for(k).lease, f"a{keys.index(k)}:1") for k in keys[5:]]
    assert leases.batch([], rest) == ([], [True] * 55)
    assert all(leases.remaining(k) == (None, None) for k in keys[5:])


def test_cluster_noscript_after_script_flush_is_reloaded_per_node(
    cluster: list[RedisServer], cluster_leases: LeaseStore
) -> None:
    leases = cluster_leases
    keys = [f"noscript:{i}" for i in range(12)]
    gens = {k: leases.claim(k, "a", TTL_MS) for k in keys}
    # Given every node forgot every script (a restart, a failover to a fresh replica),
    for n in cluster:
        with contextlib.closing(n.client()) as c:
            c.script_flush()
    # when the renewer's batch and a single claim run, they reload and retry once.
    renewals = [(leases.keys_for(k).lease, f"a:{gens[k]}", TTL_MS) for k in keys]
    releases = [(leases.keys_for(k).lease, f"a:{gens[k]}") for k in keys[:4]]
    assert leases.batch(renewals, releases) == ([True] * 12, [True] * 4)
    for n in cluster:
        with contextlib.closing(n.client()) as c:
            c.script_flush()
    assert leases.claim(keys[0], "b", TTL_MS) == gens[keys[0]] + 1  # loads claim.lua only
    # A claim carrying releases whose script is missing: only the releases are re-sent —
    # the claim that already succeeded is not sent twice (it would find its own lease busy).
    released = [(leases.keys_for(k).lease, f"a:{gens[k]}") for k in keys[5:]]
    assert leases.claim("noscript:fresh", "c", TTL_MS, releases=released) == 1
    assert all(leases.remaining(k) == (None, None) for k in keys[5:])


def _key_in_slot(leases: LeaseStore, slot: int, taken: str) -> str:
    for i in range(200_000):
        candidate = f"same-slot:{i}"
        if candidate != taken and _slot(leases, candidate) == slot:
            return candidate
    raise AssertionError("no second key found for the slot")


def test_cluster_slot_migration_ask_then_moved(
    cluster: list[RedisServer], cluster_leases: LeaseStore, store: Store
) -> None:
    leases = cluster_leases
    key = f"migrating:{uuid.uuid4().hex[:6]}"
    slot = _slot(leases, key)
    other = _key_in_slot(leases, slot, key)
    source = node_for_slot(cluster, slot)
    target = next(n for n in cluster if n is not source)
    keys = leases.keys_for(key)
    # Given a held lease (generation 1, registered) on the slot's current master,
    g1 = leases.claim(key, "a", TTL_MS)
    assert _register(store, key, g1, "a").outcome == "registered"
    # when the slot is half-way to another master and this key's two keys already moved
    # (the importing node has never run our scripts),
    begin_slot_migration(source, target, slot)
    move_keys(source, target, slot, [keys.lease, keys.generation])
    with contextlib.closing(target.client()) as c:
        c.script_flush()
    # then the renewal is answered with ASK by the source and followed to the target ...
    assert leases.batch([(keys.lease, f"a:{g1}", TTL_MS)], []) == ([True], [])
    remaining, generation = leases.remaining(key)
    assert generation == g1 and remaining is not None and remaining > 20
    # A claim in the migrating slot always misses a key (the lease), which Redis answers with
    # TRYAGAIN until the migration ends: the claim fails (redis-py gives up after its retries)
    # without handing out a generation — the message would be rescheduled, not run unfenced.
    with pytest.raises(redis.RedisError):
        leases.claim(other, "b", TTL_MS)
    # When the migration completes, the client's slot map is stale: MOVED is followed,
    finish_slot_migration(cluster, target, slot)
    assert node_for_slot(cluster, slot) is target
    assert leases.batch([(keys.lease, f"a:{g1}", TTL_MS)], [(keys.lease, f"a:{g1}")]) == (
        [True],
        [True],
    )
    # and the generation counter moved with the slot: the next claim is fenced above g1.
    g2 = leases.claim(key, "c", TTL_MS)
    assert g2 == g1 + 1
    assert leases.claim(other, "b", TTL_MS) == 1  # the failed claim issued nothing
    assert _register(store, key, g2, "c").outcome == "registered"
    with pytest.raises(StaleGeneration):
        store.end(key, Completion(generation=g1, attempt_id="a", result={"stale": True}))
    store.end(key, Completion(generation=g2, attempt_id="c", result={"ok": True}))
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", g2)


@pytest.mark.acceptance
def test_cluster_real_worker_completes_fenced_tasks_over_many_keys(
    cluster: list[RedisServer],
    tmp_path: Path,
    worker_env: dict[str, str],
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    url = f"{cluster[0].url};{cluster[2].url}"
    worker = topology_worker(
        tmp_path, worker_env, "cluster", concurrency=2, FENCE_T_FENCE_REDIS=url
    )
    worker.env["FENCE_T_FENCE_CLUSTER"] = "1"
    keys = [f"cl:{i}" for i in range(24)]
    worker.start()
    try:
        results = [client_app.work.delay(k) for k in keys]
        for r in results:
            assert r.get(timeout=60)["generation"] == 1
        store = Store(db_url)
        for k in keys:
            record = store.get(k)
            assert record is not None and (record.status, record.generation) == ("completed", 1)
            assert len(ledger.effects(redis_client, prefix, k)) == 1
        # the leases were released on the cluster (compare-and-delete by the renewer thread)
        probe_config = FenceConfig(redis_url=url, redis_cluster=True)
        probe = LeaseStore(make_redis_client(probe_config.redis), prefix=prefix)
        wait_until(
            lambda: all(probe.remaining(k) == (None, None) for k in keys), 10, what="released"
        )
    finally:
        worker.stop()


# -- Sentinel -------------------------------------------------------------------------------------


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    reason = missing_binaries("redis-server")
    if reason:
        pytest.skip(reason)
    with sentinel_set(tmp_path / "sentinel") as s:
        yield s


def _failover_losing_writes(s: SentinelSet, writes: Any) -> None:
    """Run ``writes()`` while the replica is frozen, then kill the master and let the replica
    be promoted: the writes were acknowledged by the master and are lost (async replication)."""
    wait_for_replication(s.master)
    assert s.replica.proc is not None
    # Freeze the replica and cut its link, so that nothing written from now on reaches it.
    os.killpg(s.replica.proc.pid, signal.SIGSTOP)
    try:
        with contextlib.closing(s.master.client()) as master:
            master.client_kill_filter(_type="replica")
        writes()
    finally:
        s.master.kill()
        os.killpg(s.replica.proc.pid, signal.SIGCONT)
    wait_until(
        lambda: s.current_master_port() == s.replica.port, 60, 0.2, what="sentinel promotion"
    )


def test_sentinel_failover_never_reissues_a_registered_generation(
    sentinels: SentinelSet, store: Store, prefix: str
) -> None:
    s = sentinels
    config = FenceConfig(
        redis_url=s.url,
        redis_transport_options={"master_name": s.name},
        lease_ttl=5.0,
        renew_interval=1.0,
    )
    leases = LeaseStore(make_redis_client(config.redis), prefix=prefix)
    key = "report:failover"
    lease_key = leases.keys_for(key).lease
    # Given generations 1 and 2 claimed, registered, released and replicated,
    for gen, attempt in ((1, "a1"), (2, "a2")):
        assert leases.claim(key, attempt, TTL_MS) == gen
        assert _register(store, key, gen, attempt).outcome == "registered"
        assert leases.release(lease_key, f"{attempt}:{gen}")
    # and holder A claims generation 3 and registers it — acknowledged by the master only —
    held: dict[str, int] = {}

    def claim_a() -> None:
        held["a"] = leases.claim(key, "a3", TTL_MS)
        assert _register(store, key, held["a"], "a3").outcome == "registered"

    # when the master dies before replicating it and the replica is promoted,
    _failover_losing_writes(s, claim_a)
    assert held["a"] == 3
    # then A's next renewal finds no lease: A loses its authority (no second writer) ...
    assert _eventually(lambda: leases.batch([(lease_key, "a3:3", TTL_MS)], [])) == ([False], [])
    # ... the promoted master re-issues generation 3, which the store refuses to register,
    reissued = _eventually(lambda: leases.claim(key, "b", TTL_MS))
    assert reissued == 3
    registration = _register(store, key, reissued, "b")
    assert (registration.outcome, registration.stored_generation) == ("stale", 3)
    # ... the core's set-if-greater raises the counter to the store's, and the next claim wins.
    assert leases.release(lease_key, f"b:{reissued}")
    assert leases.raise_generation(key, registration.stored_generation) == 3
    g4 = leases.claim(key, "c", TTL_MS)
    assert g4 == 4
    assert _register(store, key, g4, "c").outcome == "registered"
    # A's late write is rejected; the new owner's is the one result.
    with pytest.raises(StaleGeneration):
        store.end(key, Completion(generation=3, attempt_id="a3", result={"from": "a"}))
    store.end(key, Completion(generation=4, attempt_id="c", result={"from": "c"}))
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation, record.result) == ("completed", 4, {"from": "c"})


@pytest.mark.acceptance
def test_sentinel_failover_with_a_real_worker(
    sentinels: SentinelSet,
    tmp_path: Path,
    worker_env: dict[str, str],
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    s = sentinels
    worker = topology_worker(
        tmp_path,
        worker_env,
        "sentinel",
        concurrency=2,
        FENCE_T_FENCE_REDIS=s.url,
        FENCE_T_FENCE_MASTER=s.name,
    )
    store = Store(db_url)
    runs = functools.partial(ledger.runs, redis_client, prefix)
    effects = functools.partial(ledger.effects, redis_client, prefix)
    worker.start()
    try:
        # Given tasks completed through the master,
        before = [client_app.work.delay(f"pre:{i}") for i in range(4)]
        assert [r.get(timeout=60)["generation"] for r in before] == [1] * 4
        # and one in flight whose claim (generation 1 of its key) was never replicated,
        key = f"inflight:{uuid.uuid4().hex[:6]}"
        inflight: dict[str, Any] = {}

        def start_inflight() -> None:
            inflight["r"] = client_app.work.delay(key, sleep=6.0)
            wait_until(lambda: len(runs(key)) == 1, 30, what="the in-flight body starts")

        # when the master is killed and the replica promoted,
        _failover_losing_writes(s, start_inflight)
        # then the in-flight attempt loses its lease (its guard raises; no effect from it), the
        # job is retried on the promoted master with a generation above the store's, and
        # completes once;
        result = inflight["r"].get(timeout=120)
        assert result["generation"] >= 2
        record = store.get(key)
        assert record is not None
        assert (record.status, record.generation) == ("completed", result["generation"])
        assert runs(key)[0].startswith("1:")
        assert effects(key) == [f"{result['generation']}:{result['attempt_id']}"]
        actions = [(t.action, t.generation) for t in store.transitions.history(key)]
        assert ("completed", 1) not in actions
        # and new tasks continue on the promoted master.
        after = [client_app.work.delay(f"post:{i}") for i in range(4)]
        assert [r.get(timeout=60)["generation"] for r in after] == [1] * 4
        for i in range(4):
            rec = store.get(f"post:{i}")
            assert rec is not None and rec.status == "completed"
    finally:
        worker.stop()


def test_cluster_group_slots_and_rate_buckets_run_one_script_on_one_node(
    cluster_config: FenceConfig, cluster_leases: LeaseStore, prefix: str
) -> None:
    # Given the limits on a Redis Cluster (each limit's keys share one hash tag) ...
    limits = Limits(cluster_leases.client, prefix=prefix)
    assert not limits.carries_releases
    groups = [f"tenant:{i}" for i in range(8)]  # spread over the nodes
    for group in groups:
        taken = [limits.claim_slot(group, 2, f"tok-{i}", TTL_MS) for i in range(3)]
        assert [isinstance(t, Slot) for t in taken] == [True, True, False]
        slot = taken[0]
        assert isinstance(slot, Slot)
        assert cluster_leases.release(slot.lease_key, slot.value)  # a slot is a lease
        assert isinstance(limits.claim_slot(group, 2, "tok-x", TTL_MS), Slot)
    rate = parse_rate("1/s")
    assert [limits.take_token(f"group:{g}", rate) == 0.0 for g in groups] == [True] * 8
    assert all(limits.take_token(f"group:{g}", rate) > 0 for g in groups)
