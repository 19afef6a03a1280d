"""The outbox on both databases: staging, stable keys, claims, retries, racing senders.

Real SQLite/PostgreSQL (``db_url``), real Redis; senders are real processes where they race.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import multiprocessing
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence import FencedTask, PermanentError, StaleGeneration
from celery_fence.leases.lease import LeaseStore
from celery_fence.ops.outbox import Outbox, idempotency_key
from celery_fence.store import Effect, Store, utcnow
from celery_fence.store.records import Completion, Dead
from tests.support.env import PG_ADMIN_URL, REDIS_URL
from tests.support.stores import EVERY_DRIVER, store_url
from tests.support.worker import wait_until


@pytest.fixture(params=EVERY_DRIVER)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite, and PostgreSQL through psycopg2 and through psycopg 3."""
    return store_url(request, tmp_path)


def _effect(key: str, name: str, payload: Any) -> Effect:
    return Effect(name=name, payload=payload, idempotency_key=idempotency_key(key, name))


def _completed_job(store: Store, key: str, *effects: Effect, generation: int = 1) -> None:
    attempt = uuid.uuid4().hex
    store.register(key, generation=generation, attempt_id=attempt, task_name="t")
    store.end(
        key, Completion(generation=generation, attempt_id=attempt, result={}, effects=effects)
    )


@pytest.fixture
def app(db_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery(f"outbox-{prefix}", set_as_current=False)
    app.conf.update(
        fence_database_url=db_url,
        fence_redis_url=REDIS_URL,
        fence_key_prefix=prefix,
        fence_max_attempts=3,
        fence_retry_backoff=0.05,
        fence_retry_backoff_max=0.1,
        # the outbox's own retry settings (hours by default): 3 deliveries 0.025-0.1 s apart
        fence_outbox_max_attempts=3,
        fence_outbox_backoff=0.05,
        fence_outbox_backoff_max=0.1,
        fence_lease_ttl=2.0,
        fence_renew_interval=0.5,
        task_always_eager=True,  # the post-completion trigger delivers inline, in this process
    )
    yield app
    app.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def own_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of this test's own: a sender sweeps every row in it, not just this test's."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'race.sqlite3'}"
        Store(url).create_schema()
        yield url
        return
    name = f"celery_fence_race_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    Store(url).create_schema()
    yield url
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def test_effects_are_written_only_with_the_fenced_completion(store: Store) -> None:
    key = f"job:{uuid.uuid4().hex[:8]}"
    # Given generation 1 registered, then superseded by generation 2,
    store.register(key, generation=1, attempt_id="a1", task_name="t")
    store.register(key, generation=2, attempt_id="a2", task_name="t")
    # when generation 1 completes with a staged effect, it is rejected and writes nothing;
    with pytest.raises(StaleGeneration):
        store.end(
            key,
            Completion(
                generation=1, attempt_id="a1", result={}, effects=[_effect(key, "e", {"g": 1})]
            ),
        )
    assert store.outbox_rows.rows(key=key) == []
    # generation 2's completion writes its effects with it, exactly once,
    effects = [_effect(key, "email:alice", {"g": 2}), _effect(key, "email:bob", {"g": 2})]
    store.end(key, Completion(generation=2, attempt_id="a2", result={"ok": True}, effects=effects))
    with pytest.raises(StaleGeneration):  # a replayed completion adds no second copy
        store.end(key, Completion(generation=2, attempt_id="a2", result={}, effects=effects))
    rows = sorted(store.outbox_rows.rows(key=key), key=lambda r: r.name)
    assert [(r.name, r.payload, r.status, r.attempts) for r in rows] == [
        ("email:alice", {"g": 2}, "pending", 0),
        ("email:bob", {"g": 2}, "pending", 0),
    ]
    assert [r.idempotency_key for r in rows] == [e.idempotency_key for e in effects]
    # and a job that fails instead of completing writes none.
    other = f"job:{uuid.uuid4().hex[:8]}"
    store.register(other, generation=1, attempt_id="b1", task_name="t")
    store.end(other, Dead(generation=1, attempt_id="b1", error=ValueError("x"), reason="test"))
    assert store.outbox_rows.rows(key=other) == []


def test_idempotency_key_is_the_same_for_every_attempt(
    app: Celery, store: Store, prefix: str, redis_client: redis.Redis
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    outbox = Outbox(app)
    delivered: list[tuple[Any, str]] = []
    staged: list[tuple[str, str]] = []

    @outbox.handler("notify")
    def notify(payload: Any, *, idempotency_key: str) -> None:
        delivered.append((payload, idempotency_key))

    @app.task(base=FencedTask, bind=True, fence_key=lambda k, fail: k)
    def job(self: Any, k: str, fail: bool) -> str:
        staged.append((self.fence.attempt_id, self.fence.effects.add("notify", {"report": k})))
        if fail:
            raise ConnectionError("transient, after staging")
        return "done"

    # Given a first attempt that stages the effect and then fails (a retry is scheduled),
    with pytest.raises(ConnectionError):
        job(key, True)
    assert store.outbox_rows.rows(key=key) == []
    lease_key = LeaseStore(redis_client, prefix=prefix).keys_for(key).lease
    wait_until(lambda: not redis_client.exists(lease_key), 10, what="lease released")
    # when a second attempt stages it again and completes,
    assert job(key, False) == "done"
    # then both attempts got the same key, derived from the logical key and the name only,
    (attempt1, key1), (attempt2, key2) = staged
    assert attempt1 != attempt2 and key1 == key2 == idempotency_key(key, "notify")
    # and the one row carrying it was delivered (inline: task_always_eager) with that key.
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.idempotency_key, row.status, row.attempts) == (key1, "delivered", 1)
    assert delivered == [({"report": key}, key1)]


def test_staging_and_rows_have_one_name_each(app: Celery, store: Store) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    Outbox(app)
    seen: dict[str, bool] = {}

    @app.task(base=FencedTask, bind=True, fence_key=lambda k: k)
    def job(self: Any, k: str) -> None:
        seen["fence.outbox"] = hasattr(self.fence, "outbox")
        self.fence.effects.add("notify:a", {"via": "effects"})

    # Given a body that stages one effect (no handler: the row stays pending),
    job(key)
    # then the staging side is only ``fence.effects`` and the rows only ``store.outbox_rows``
    # (the aliases ``fence.outbox`` and ``store.outbox`` were removed),
    assert seen == {"fence.outbox": False}
    assert not hasattr(store, "outbox")
    # and the staged effect is a row of the completion.
    rows = store.outbox_rows.rows(key=key)
    assert [(r.name, r.payload, r.status) for r in rows] == [
        ("notify:a", {"via": "effects"}, "pending"),
    ]


def test_an_expired_claim_is_taken_over_and_the_late_mark_refused(store: Store) -> None:
    key = f"job:{uuid.uuid4().hex[:8]}"
    _completed_job(store, key, _effect(key, "e", None))
    # Given sender A's claim on the row,
    (claimed,) = store.outbox_rows.claim(claimer="A", claim_ttl=0.5, key=key)
    # then B cannot claim it while A's claim lives,
    assert store.outbox_rows.claim(claimer="B", claim_ttl=30, key=key) == []
    # but once it expired (A crashed after sending?), B claims it: a second delivery,
    taken: list[Any] = []

    def claimed_by_b() -> list[Any]:
        taken.extend(store.outbox_rows.claim(claimer="B", claim_ttl=30, key=key))
        return taken

    wait_until(
        claimed_by_b,
        10,
        what="B's claim after A's expired",
    )
    assert taken[0].id == claimed.id and taken[0].attempts == 2
    assert taken[0].idempotency_key == claimed.idempotency_key  # same key: the recipient dedupes
    # and A, late, can neither mark nor fail the row; B can.
    assert not store.outbox_rows.mark_delivered(claimed.id, claimer="A")
    assert not store.outbox_rows.fail(claimed.id, claimer="A", error=OSError(), retry_at=None)
    assert store.outbox_rows.mark_delivered(claimed.id, claimer="B")
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.status, row.claimed_by, row.attempts) == ("delivered", "B", 2)
    assert store.outbox_rows.claim(claimer="C", claim_ttl=30, key=key) == []
    # A delivered row is purged once old enough (the cut-off is exclusive).
    assert row.delivered_at is not None
    store.outbox_rows.purge(
        delivered_before=row.delivered_at
    )  # other tests' rows may go (shared db)
    assert [r.id for r in store.outbox_rows.rows(key=key)] == [row.id]
    assert store.outbox_rows.purge(delivered_before=utcnow() + dt.timedelta(seconds=1)) >= 1
    assert store.outbox_rows.rows(key=key) == []


def test_failures_back_off_then_dead_letter(app: Celery, store: Store) -> None:
    key = f"job:{uuid.uuid4().hex[:8]}"
    _completed_job(store, key, _effect(key, "flaky", {"n": 1}), _effect(key, "bad", {"n": 2}))
    outbox = Outbox(app)  # fence_outbox_max_attempts=3, backoff <= 0.1 s
    calls: Counter[str] = Counter()

    @outbox.handler("flaky")
    def flaky(payload: Any, *, idempotency_key: str) -> None:
        calls["flaky"] += 1
        raise ConnectionError("provider down")

    @outbox.handler("bad")
    def bad(payload: Any, *, idempotency_key: str) -> None:
        calls["bad"] += 1
        raise PermanentError("rejected by the provider")

    # Given a permanent failure: dead at once; a transient one: pending again, later.
    report = outbox.deliver(key=key)
    assert (report.delivered, report.failed, report.dead) == (0, 1, 1)
    assert report.retry_in is not None and report.retry_in <= 0.1
    rows = {r.name: r for r in store.outbox_rows.rows(key=key)}
    assert (rows["bad"].status, rows["flaky"].status) == ("dead", "pending")
    assert rows["flaky"].available_at > rows["flaky"].created_at
    assert "ConnectionError" in (rows["flaky"].last_error or "")
    # When it keeps failing, it is retried until fence_outbox_max_attempts, then dead-lettered.
    wait_until(
        lambda: (
            (outbox.deliver(key=key), store.outbox_rows.rows(key=key, status="dead"))[1].__len__()
            == 2
        ),
        10,
        what="flaky dead-lettered",
    )
    rows = {r.name: r for r in store.outbox_rows.rows(key=key)}
    assert (rows["flaky"].status, rows["flaky"].attempts, calls["flaky"]) == ("dead", 3, 3)
    assert calls["bad"] == 1
    # An operator can requeue a dead row; the sender then delivers it.
    outbox.register("flaky", lambda payload, *, idempotency_key: None)
    assert store.outbox_rows.requeue(rows["flaky"].id)
    assert outbox.deliver(key=key).delivered == 1
    assert store.outbox_rows.rows(key=key, status="delivered")[0].name == "flaky"


def test_payloads_never_reach_the_logs(
    app: Celery, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"job:{uuid.uuid4().hex[:8]}"
    secret = f"s3cret-{uuid.uuid4().hex}"
    _completed_job(store, key, _effect(key, "a", {"card": secret}), _effect(key, "b", secret))
    outbox = Outbox(app)
    outbox.register("a", lambda payload, *, idempotency_key: None)

    def fails(payload: Any, *, idempotency_key: str) -> None:
        raise ValueError(f"provider said: bad card {payload}")

    outbox.register("b", fails)
    with caplog.at_level(logging.DEBUG):
        report = outbox.deliver(key=key)
    assert (report.delivered, report.failed) == (1, 1)
    assert caplog.records and key in caplog.text
    assert secret not in caplog.text


def test_no_handler_is_a_failure_not_a_skip(app: Celery, store: Store) -> None:
    key = f"job:{uuid.uuid4().hex[:8]}"
    _completed_job(store, key, _effect(key, "sms:bob", {}))
    report = Outbox(app).deliver(key=key)
    assert report.failed == 1
    (row,) = store.outbox_rows.rows(key=key)
    assert row.status == "pending" and "NoHandler" in (row.last_error or "")


def test_two_sender_processes_racing_deliver_each_row_once_per_claim(
    own_db_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    store, db_url = Store(own_db_url), own_db_url
    # Given 40 committed effects,
    keys = []
    for i in range(40):
        key = f"race:{prefix}:{i}"
        _completed_job(store, key, _effect(key, "race", {"i": i}))
        keys.append(idempotency_key(key, "race"))
    ledger_key, barrier_key = f"{prefix}:race:ledger", f"{prefix}:race:go"
    # when two sender processes start on them at the same moment,
    ctx = multiprocessing.get_context("spawn")
    senders = [
        ctx.Process(target=race_sender(), args=(db_url, REDIS_URL, ledger_key, barrier_key))
        for _ in range(2)
    ]
    for p in senders:
        p.start()
    try:
        time.sleep(0.5)  # not a correctness wait: lets both processes import before the start
        redis_client.set(barrier_key, 1)
        for p in senders:
            p.join(timeout=90)
            assert p.exitcode == 0
    finally:
        for p in senders:
            if p.is_alive():
                p.kill()
    # then every row was delivered exactly once — none twice, none skipped —
    deliveries = [json.loads(v) for v in redis_client.lrange(ledger_key, 0, -1)]
    per_key = Counter(k for k, _ in deliveries)
    assert set(per_key) == set(keys)
    assert set(per_key.values()) == {1}
    # each delivery is one claim, and both senders took part.
    rows = store.outbox_rows.rows()
    assert len(rows) == 40
    assert {(r.status, r.attempts) for r in rows} == {("delivered", 1)}
    assert len({pid for _, pid in deliveries}) == 2
    store.dispose()


def _post(url: str, body: Any, key: str | None, timeout: float = 5.0) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_provider_stub_standalone_performs_each_key_once() -> None:
    # Given the stub as its own process (as the chaos suite runs it),
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_fence.testing.provider", "--port", "0", "--fail-first", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        # a failure before performing is not stored: the retry performs it,
        assert _post(f"{url}/emails", {"to": "a"}, "k1")[0] == 503
        status, first = _post(f"{url}/emails", {"to": "a"}, "k1")
        assert status == 200
        # a repeat replays the stored response; another body under the same key is refused,
        assert _post(f"{url}/emails", {"to": "a"}, "k1") == (200, first)
        assert _post(f"{url}/emails", {"to": "b"}, "k1")[0] == 422
        # a delayed answer times out the client after the work was done, and the retry replays.
        assert _post(f"{url}/_control", {"delay_next": 1.5, "path": "/pay"}, None)[0] == 200
        with pytest.raises(OSError):
            _post(f"{url}/pay", {"n": 1}, "k2", timeout=0.3)
        assert _post(f"{url}/pay", {"n": 1}, "k2")[0] == 200
        with urllib.request.urlopen(f"{url}/stats", timeout=5) as response:
            stats = json.loads(response.read())
        assert (stats["performed"], stats["requests"]) == (2, 6)
        assert stats["by_key"]["k1"]["requests"] == 3 and stats["by_key"]["k2"]["requests"] == 2
        assert stats["by_key"]["k2"]["response"]["request"] == {"n": 1}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def race_sender() -> Any:
    """The sender body, looked up now: other tests re-import its module (spawn pickles by name)."""
    import importlib

    return importlib.import_module("tests.support.outbox_app").race_sender


@pytest.mark.filterwarnings("ignore::celery_fence.errors.FenceEagerWarning")  # apply(headers=)
def test_a_completed_key_re_run_by_the_operator_records_and_delivers_its_effects_anew(
    app: Celery, store: Store, prefix: str, redis_client: redis.Redis, caplog: Any
) -> None:
    """``fence requeue --completed KEY``: the re-run's effects are recorded and delivered with
    idempotency keys of their own (its run number in them); the first run's keep theirs, and
    every attempt of one run stages the same key (a redelivery of the run still dedupes)."""
    from celery_fence.ops.recovery import execution_for

    RUN_HEADER = "fence_run"  # the header's public name

    key = f"invoice:{uuid.uuid4().hex[:8]}"
    outbox = Outbox(app)
    delivered: list[tuple[Any, str]] = []
    staged: list[str] = []

    @outbox.handler("email")
    def email(payload: Any, *, idempotency_key: str) -> None:
        delivered.append((payload, idempotency_key))

    failures = [0]

    @app.task(base=FencedTask, bind=True, fence_key=lambda k, total: k)
    def bill(self: Any, k: str, total: int) -> int:
        staged.append(self.fence.effects.add("email", {"total": total}))
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("transient, after staging")
        return total

    lease_key = LeaseStore(redis_client, prefix=prefix).keys_for(key).lease

    def released() -> None:
        wait_until(lambda: not redis_client.exists(lease_key), 10, what="lease released")

    # Given a key that completed once, its email recorded and delivered under the first key,
    bill.apply((key, 100)).get()
    first = idempotency_key(key, "email")
    assert delivered == [({"total": 100}, first)]
    released()
    # when the operator requeues it as completed (the message it sends carries the run number),
    requeued = store.admin.requeue(key, completed=True)
    headers = execution_for(requeued)["headers"]
    assert headers[RUN_HEADER] == 1
    stored = store.get(key)
    assert stored is not None and stored.request is not None
    assert stored.request["execution"]["headers"][RUN_HEADER] == 1  # recovery re-sends it too
    # and the re-run's first attempt fails after staging (run eagerly, the error is the
    # caller's), then the run's message is delivered again, with its headers,
    failures[0] = 1
    with caplog.at_level(logging.INFO, logger="celery_fence"):
        failed = bill.apply((key, 120), headers=headers)
        assert isinstance(failed.result, ConnectionError)
        released()
        assert bill.apply((key, 120), headers=headers).get() == 120
    # then both attempts of the re-run staged one key, new for this run and not the first's,
    rerun = idempotency_key(key, "email", 1)
    assert staged == [first, rerun, rerun] and rerun != first
    # the re-run's row is recorded beside the first run's and delivered once, with that key,
    rows = sorted(store.outbox_rows.rows(key=key), key=lambda r: r.id)
    assert [(r.idempotency_key, r.payload, r.status, r.attempts) for r in rows] == [
        (first, {"total": 100}, "delivered", 1),
        (rerun, {"total": 120}, "delivered", 1),
    ]
    assert delivered == [({"total": 100}, first), ({"total": 120}, rerun)]
    # and the record is a log line (key and run, never the payload).
    recorded = [r.getMessage() for r in caplog.records if "outbox recorded" in r.getMessage()]
    assert recorded == [f"fence outbox recorded key={key} effects=1 run=1"]
    assert "120" not in " ".join(recorded)
    # A second requeue is run 2: keys of its own again.
    released()
    again = execution_for(store.admin.requeue(key, completed=True))["headers"]
    assert again[RUN_HEADER] == 2
    assert bill.apply((key, 130), headers=again).get() == 130
    assert delivered[-1] == ({"total": 130}, idempotency_key(key, "email", 2))
    assert len({r.idempotency_key for r in store.outbox_rows.rows(key=key)}) == 3


@pytest.mark.filterwarnings("ignore::celery_fence.errors.FenceEagerWarning")  # apply()
def test_the_first_message_redelivered_late_after_a_requeue_runs_as_the_operators_re_run(
    app: Celery, store: Store, prefix: str, redis_client: redis.Redis
) -> None:
    """After ``fence requeue --completed KEY``, the key's first message (no ``fence_run``
    header) delivered again before the re-run's message claims the job runs as run 1: the run
    number comes from the job row the registration takes, so its effect is recorded and
    delivered with the run's idempotency key, never dropped as the first run's duplicate."""
    key = f"invoice:{uuid.uuid4().hex[:8]}"
    outbox = Outbox(app)
    delivered: list[tuple[Any, str]] = []
    staged: list[str] = []

    @outbox.handler("email")
    def email(payload: Any, *, idempotency_key: str) -> None:
        delivered.append((payload, idempotency_key))

    @app.task(base=FencedTask, bind=True, fence_key=lambda k, total: k)
    def bill(self: Any, k: str, total: int) -> int:
        staged.append(self.fence.effects.add("email", {"total": total}))
        return total

    lease_key = LeaseStore(redis_client, prefix=prefix).keys_for(key).lease
    # Given a key that completed once, its email recorded and delivered under the first key,
    assert bill.apply((key, 100)).get() == 100
    first = idempotency_key(key, "email")
    wait_until(lambda: not redis_client.exists(lease_key), 10, what="lease released")
    # when the operator requeues it as completed and a message WITHOUT the run header (the
    # first run's, redelivered late) claims the job before the re-run's message does,
    store.admin.requeue(key, completed=True)
    assert bill.apply((key, 120)).get() == 120
    # then it ran as run 1: its effect staged, recorded and delivered under the run's key.
    rerun = idempotency_key(key, "email", 1)
    assert staged == [first, rerun]
    rows = sorted(store.outbox_rows.rows(key=key), key=lambda r: r.id)
    assert [(r.idempotency_key, r.payload, r.status) for r in rows] == [
        (first, {"total": 100}, "delivered"),
        (rerun, {"total": 120}, "delivered"),
    ]
    assert delivered == [({"total": 100}, first), ({"total": 120}, rerun)]
    job = store.get(key)
    assert job is not None and job.status == "completed" and job.result == 120


def test_a_purged_key_sent_again_runs_as_new_work_with_the_same_idempotency_keys(
    app: Celery, store: Store, prefix: str, redis_client: redis.Redis
) -> None:
    """What ``fence purge`` promises of a purged key: sent again, it runs again as new work
    (nothing is left to replay), and its outbox effects carry the same idempotency keys as the
    first run's, so a provider that dedupes on them does not charge twice."""
    key = f"charge:{uuid.uuid4().hex[:8]}"
    outbox = Outbox(app)
    delivered: list[str] = []
    runs: list[str] = []

    @outbox.handler("charge")
    def charge(payload: Any, *, idempotency_key: str) -> None:
        delivered.append(idempotency_key)

    @app.task(base=FencedTask, bind=True, fence_key=lambda k: k)
    def pay(self: Any, k: str) -> str:
        runs.append(self.fence.attempt_id)
        return self.fence.effects.add("charge", {"cents": 500})

    # Given a key that completed and whose charge was delivered,
    first = pay(key)
    assert delivered == [first] == [idempotency_key(key, "charge")]
    lease_key = LeaseStore(redis_client, prefix=prefix).keys_for(key).lease
    wait_until(lambda: not redis_client.exists(lease_key), 10, what="lease released")
    # when everything finished before now is purged (what fence purge --force does),
    now = utcnow() + dt.timedelta(seconds=1)
    assert store.admin.purge(finished_before=now) >= 1
    assert store.outbox_rows.purge(delivered_before=now) >= 1
    assert store.get(key) is None and store.outbox_rows.rows(key=key) == []
    # then the key sent again runs its body again (new work: a second run),
    assert pay(key) == first
    assert len(runs) == 2
    # and its charge goes out again with the first run's idempotency key: the provider dedupes.
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.idempotency_key, row.status) == (first, "delivered")
    assert delivered == [first, first]


def test_the_idempotency_namespace_reaches_the_stored_row_and_the_handler(
    app: Celery, store: Store
) -> None:
    # Given an environment (staging) that shares its provider account with production,
    app.conf.fence_idempotency_namespace = "staging"
    key = f"order:{uuid.uuid4().hex[:8]}"
    outbox = Outbox(app)
    delivered: list[str] = []

    @outbox.handler("email")
    def email(payload: Any, *, idempotency_key: str) -> None:
        delivered.append(idempotency_key)

    @app.task(base=FencedTask, bind=True, fence_key=lambda k: k)
    def job(self: Any, k: str) -> str:
        return self.fence.effects.add("email", {"order": k})

    # when a fenced task stages an effect and completes,
    staged = job(key)
    # then the stored row and the handler carry the namespaced key, not production's.
    assert (
        staged
        == idempotency_key(key, "email", namespace="staging")
        != idempotency_key(key, "email")
    )
    (row,) = store.outbox_rows.rows(key=key)
    assert row.idempotency_key == staged
    assert delivered == [staged]
