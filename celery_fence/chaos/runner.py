"""Running scenarios: a database for each (a throwaway PostgreSQL one when needed), one
:class:`~celery_fence.chaos.scenario.Scenario` at a time, the checker over what happened."""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from celery_fence.chaos import checker, checker_limits
from celery_fence.chaos.checker import ScenarioResult
from celery_fence.chaos.options import OWN_CLUSTER, POSTGRESQL_ONLY, Options
from celery_fence.chaos.scenario import Scenario
from celery_fence.chaos.scenarios import RUNS
from celery_fence.testing.postgres_server import PostgresCluster
from celery_fence.testing.processes import (
    RedisServer,
    cleanup,
    install_handlers,
    register_closer,
)
from celery_fence.testing.proxy import TcpProxy


def _pg_database(opts: Options, scenario: str) -> tuple[str, str] | str:
    """(URL, name to drop afterwards or "") of the PostgreSQL database ``scenario`` runs against:
    ``--database-url`` when it is PostgreSQL, else a fresh one made through ``--pg-admin-url``;
    or the reason there is none."""
    if opts.database_url and opts.database_url.startswith("postgresql"):
        return opts.database_url, ""
    name = f"celery_fence_chaos_{uuid.uuid4().hex[:10]}"
    try:
        admin = sa.create_engine(opts.pg_admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        admin.dispose()
    except Exception as exc:
        return f"{scenario} needs PostgreSQL (--pg-admin-url): {type(exc).__name__}: {exc}"[:300]
    url = sa.engine.make_url(opts.pg_admin_url).set(database=name)
    return url.render_as_string(hide_password=False), name


def _drop_database(opts: Options, name: str) -> None:
    admin = sa.create_engine(opts.pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def _proxied(url: str, proxy: TcpProxy) -> str:
    return (
        sa.engine.make_url(url)
        .set(host="127.0.0.1", port=proxy.port)
        .render_as_string(hide_password=False)
    )


# -- one scenario --------------------------------------------------------------------------------


def run_scenario(
    name: str, opts: Options, workdir: Path, own_redis: RedisServer | None, rng: random.Random
) -> ScenarioResult:
    result = ScenarioResult(scenario=name)
    lease_url = own_redis.url if own_redis is not None else opts.redis_url
    proxy = None
    cluster = None
    drop: str | None = None
    if name in OWN_CLUSTER:
        try:
            cluster = PostgresCluster()
            register_closer(cluster.stop)
            cluster.start()
        except Exception as exc:
            result.skipped = f"{name} needs its own PostgreSQL cluster: {exc}"[:500]
            if cluster is not None:
                cluster.stop()
            return result
        database_url = worker_url = cluster.url()
    elif name in POSTGRESQL_ONLY:
        found = _pg_database(opts, name)
        if isinstance(found, str):
            result.skipped = found
            return result
        database_url, drop = found
        worker_url = database_url
        if name == "db-outage":
            upstream = sa.engine.make_url(database_url)
            proxy = TcpProxy(upstream.host or "127.0.0.1", upstream.port or 5432)
            worker_url = _proxied(database_url, proxy)
    else:
        database_url = opts.database_url or f"sqlite:///{workdir / f'{name}.sqlite3'}"
        worker_url = database_url
    if drop:
        register_closer(lambda: _drop_database(opts, drop))
    s = Scenario(name, opts, workdir, lease_url, own_redis, database_url, worker_url, proxy)
    s.cluster = cluster
    try:
        s.start()
        for i in range(opts.runs):
            try:
                faults, elapsed = RUNS[name](s, i, rng)
            except Exception as exc:  # a harness step timed out: report it, check what ran
                result.error = f"run {i + 1} aborted: {type(exc).__name__}: {exc}"[:500]
                s.abandon()  # the run's jobs are still checked: unfinished ones are lost
                break
            result.runs += 1
            result.faults += faults
            result.max_converge_s = max(result.max_converge_s, elapsed)
            if not opts.quiet:
                print(
                    f"  {name} run {i + 1}/{opts.runs}: {faults} faults, {elapsed:.2f}s", flush=True
                )
        time.sleep(0.5)  # let the last writes and ledger entries land
        ledger = checker.parse_ledger(s.ledger.lrange(f"{s.ledger_prefix}:events", 0, -1))
        checker.check(result, s.jobs, s.store, ledger, s.provider.stats())
        checker_limits.check(result, s.measures, ledger)
    finally:
        s.stop()
        if cluster is not None:
            cluster.remove()
        if drop:
            with contextlib.suppress(Exception):
                _drop_database(opts, drop)
    return result


def run(opts: Options) -> list[ScenarioResult]:
    install_handlers()
    rng = random.Random(opts.seed)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="celery-fence-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    own_redis = RedisServer(workdir).start() if opts.own_redis else None
    results = []
    try:
        for name in opts.scenarios:
            if not opts.quiet:
                print(f"scenario {name} ...", flush=True)
            results.append(run_scenario(name, opts, workdir, own_redis, rng))
    finally:
        cleanup()
    if not opts.workdir and all(r.safe for r in results):
        shutil.rmtree(workdir, ignore_errors=True)
    elif not opts.quiet:
        print(f"worker logs kept in {workdir}", flush=True)
    return results
