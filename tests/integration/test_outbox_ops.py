"""The outbox for operators: ``fence show`` lists a job's effects, ``fence outbox ls`` and
``fence outbox requeue``, and the delivery's own capped backoff (``fence_outbox_*``).

Real SQLite and PostgreSQL (``db_url``), the CLI run as a subprocess (as in test_cli.py); the
deliveries run in this process through :class:`~celery_fence.ops.outbox.Outbox`, no worker.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence.config import FenceConfig
from celery_fence.ops.outbox import (
    DELIVER_TASK,
    DeliveryReport,
    Outbox,
)
from celery_fence.ops.outbox_backoff import dead_after, retry_ceiling
from celery_fence.schema import outbox as outbox_table
from celery_fence.store import Effect, OutboxRow, Store
from celery_fence.store.records import Completion
from celery_fence.testing.broker import delete_queues
from tests.integration.test_cli import UNREACHABLE_PG, assert_one_line_error, fence_cli, ok
from tests.support.env import BROKER_URL, REDIS_URL
from tests.support.worker import wait_until

SECRET = "4111-1111-1111-1111"  # a payload value that must never be printed


def _job_with_effects(store: Store, task_name: str, *names: str) -> str:
    """A completed job whose effects ``names`` are pending; each payload holds :data:`SECRET`."""
    key = f"job:{uuid.uuid4().hex[:10]}"
    store.register(key, generation=1, attempt_id="A", task_name=task_name)
    effects = [Effect(n, {"card": SECRET, "n": n}, f"{key}:{n}") for n in names]
    store.end(key, Completion(generation=1, attempt_id="A", result=None, effects=effects))
    return key


def _row(store: Store, key: str, name: str) -> OutboxRow:
    (row,) = [r for r in store.outbox_rows.rows(key=key) if r.name == name]
    return row


def _deliver(store: Store, key: str, name: str) -> None:
    for row in store.outbox_rows.claim(claimer="ops-test", claim_ttl=30, limit=10, key=key):
        if row.name == name:
            assert store.outbox_rows.mark_delivered(row.id, claimer="ops-test")
        else:  # put it back as it was: due now, unclaimed
            assert store.outbox_rows.fail(
                row.id, claimer="ops-test", error=ConnectionError("x"), retry_in=0
            )


def _kill(store: Store, key: str, name: str) -> int:
    """Make ``name`` dead the way a sender does: claimed, then failed with no retry."""
    rows = store.outbox_rows.claim(claimer="ops-kill", claim_ttl=30, limit=10, key=key)
    for row in rows:
        dead = row.name == name
        assert store.outbox_rows.fail(
            row.id,
            claimer="ops-kill",
            error=ConnectionError("provider down") if dead else ConnectionError("x"),
            retry_in=None if dead else 0,
        )
    return _row(store, key, name).id


@pytest.fixture
def effects_job(fence_store: Store, worker_env: dict[str, str], prefix: str) -> str:
    """A job with three effects: ``sent`` delivered, ``broken`` dead, ``waiting`` pending."""
    fence_store.create_schema()
    key = _job_with_effects(fence_store, f"{prefix}.t", "sent", "broken", "waiting")
    _deliver(fence_store, key, "sent")
    _kill(fence_store, key, "broken")
    return key


def test_show_lists_the_effects_without_payloads(
    fence_store: Store, worker_env: dict[str, str], effects_job: str
) -> None:
    key = effects_job
    rows = {r.name: r for r in fence_store.outbox_rows.rows(key=key)}
    assert {n: r.status for n, r in rows.items()} == {
        "sent": "delivered",
        "broken": "dead",
        "waiting": "pending",
    }

    text = ok(fence_cli(worker_env, "show", key))
    assert SECRET not in text and "card" not in text
    section = text[text.index("\neffects:") + 1 :].splitlines()[2:]  # after the table's header
    # the effects table's rows: indented, up to the next section (``steps:``, ...)
    effects = [line for line in itertools.takewhile(lambda line: line.startswith(" "), section)]
    by_name = {line.split()[1]: line for line in effects}
    assert set(by_name) == {"sent", "broken", "waiting"}
    for name, row in rows.items():
        line = by_name[name]
        assert line.split()[:4] == [str(row.id), name, row.status, str(row.attempts)]
        assert row.idempotency_key in line
    assert "ConnectionError: provider down" in by_name["broken"]

    out = ok(fence_cli(worker_env, "show", key, "--json"))
    assert SECRET not in out
    shown = {e["name"]: e for e in json.loads(out)["effects"]}
    assert set(shown) == set(rows)
    for name, row in rows.items():
        e = shown[name]
        assert "payload" not in e
        assert (e["id"], e["status"], e["attempts"], e["idempotency_key"]) == (
            row.id,
            row.status,
            row.attempts,
            row.idempotency_key,
        )
    assert shown["broken"]["last_error"] == "builtins.ConnectionError: provider down"
    assert shown["sent"]["delivered_at"] is not None and shown["sent"]["last_error"] is None


def test_outbox_ls_lists_filters_and_prints_json(
    fence_store: Store, worker_env: dict[str, str], effects_job: str
) -> None:
    key = effects_job
    rows = {r.name: r for r in fence_store.outbox_rows.rows(key=key)}

    text = ok(fence_cli(worker_env, "outbox", "ls", "--key", key))
    assert SECRET not in text
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["ID", "KEY", "NAME", "STATUS", "ATTEMPTS"]
    listed = [line.split()[:4] for line in lines[1:]]
    newest_first = sorted(rows.values(), key=lambda r: r.id, reverse=True)
    assert listed == [[str(r.id), key, r.name, r.status] for r in newest_first]

    dead = ok(fence_cli(worker_env, "outbox", "ls", "--dead", "--key", key)).splitlines()
    assert [line.split()[:4] for line in dead[1:]] == [
        [str(rows["broken"].id), key, "broken", "dead"]
    ]

    out = ok(fence_cli(worker_env, "outbox", "ls", "--dead", "--key", key, "--json"))
    assert SECRET not in out
    (doc,) = json.loads(out)
    assert "payload" not in doc
    assert (doc["id"], doc["key"], doc["name"], doc["status"], doc["attempts"]) == (
        rows["broken"].id,
        key,
        "broken",
        "dead",
        rows["broken"].attempts,
    )
    assert doc["last_error"] == "builtins.ConnectionError: provider down"
    assert doc["idempotency_key"] == rows["broken"].idempotency_key

    limited = fence_cli(worker_env, "outbox", "ls", "--key", key, "--limit", "1", "--json")
    assert [d["id"] for d in json.loads(ok(limited))] == [newest_first[0].id]
    assert "--limit" in limited.stderr
    assert ok(fence_cli(worker_env, "outbox", "ls", "--key", "job:none")).strip() == "no effects"
    assert (
        json.loads(ok(fence_cli(worker_env, "outbox", "ls", "--key", "job:none", "--json"))) == []
    )


def test_requeue_of_a_dead_effect_delivers_it_on_the_next_sweep(
    fence_store: Store, worker_env: dict[str, str], effects_job: str, db_url: str, prefix: str
) -> None:
    key = effects_job
    dead_id = _row(fence_store, key, "broken").id

    out = ok(fence_cli(worker_env, "outbox", "requeue", str(dead_id)))
    assert out.strip() == f"requeued 1 outbox effect(s): {dead_id}"
    row = _row(fence_store, key, "broken")
    assert (row.status, row.attempts, row.claimed_by) == ("pending", 0, None)

    app = Celery(f"ops-{prefix}", set_as_current=False)
    app.conf.update(fence_database_url=db_url, fence_redis_url=REDIS_URL, fence_key_prefix=prefix)
    try:
        outbox = Outbox(app)
        got: list[tuple[Any, str]] = []
        for name in ("broken", "waiting"):
            outbox.register(
                name, lambda payload, *, idempotency_key: got.append((payload, idempotency_key))
            )
        # the sweep's pass (deliver(key=None)), kept to this job's rows on the shared database
        report = outbox.deliver(key=key)
    finally:
        app.close()
    assert report.delivered == 2 and report.failed == report.dead == 0
    assert _row(fence_store, key, "broken").status == "delivered"
    assert (got[0][0]["n"], got[0][1]) == ("broken", f"{key}:broken")


def test_requeue_refuses_what_is_not_dead_and_names_unknown_ids(
    fence_store: Store, worker_env: dict[str, str], effects_job: str
) -> None:
    key = effects_job
    rows = {r.name: r for r in fence_store.outbox_rows.rows(key=key)}
    sent, broken, waiting = rows["sent"].id, rows["broken"].id, rows["waiting"].id

    # An unknown id fails the command before anything changes, and is named.
    unknown = 10**12 + 7
    assert_one_line_error(
        fence_cli(worker_env, "outbox", "requeue", str(broken), str(unknown)),
        1,
        str(unknown),
        "nothing requeued",
    )
    assert _row(fence_store, key, "broken").status == "dead"

    # Rows that are not dead are left as they are, and said (exit 1).
    refused = fence_cli(worker_env, "outbox", "requeue", str(sent), str(waiting))
    assert_one_line_error(refused, 1, f"{sent} is delivered", f"{waiting} is pending")
    assert refused.stdout.strip() == "requeued 0 outbox effects"
    after = {r.name: r for r in fence_store.outbox_rows.rows(key=key)}
    assert [(after[n].status, after[n].attempts) for n in ("sent", "waiting")] == [
        (rows["sent"].status, rows["sent"].attempts),
        (rows["waiting"].status, rows["waiting"].attempts),
    ]

    # Mixed: the dead one is requeued, the other named.
    mixed = fence_cli(worker_env, "outbox", "requeue", str(broken), str(waiting))
    assert_one_line_error(mixed, 1, f"{waiting} is pending")
    assert mixed.stdout.strip() == f"requeued 1 outbox effect(s): {broken}"
    assert _row(fence_store, key, "broken").status == "pending"
    # A second requeue of it finds it no longer dead: the statement is conditional.
    again = fence_cli(worker_env, "outbox", "requeue", str(broken))
    assert_one_line_error(again, 1, f"{broken} is pending")

    # Usage errors.
    assert_one_line_error(fence_cli(worker_env, "outbox", "requeue"), 2, "--dead")
    assert_one_line_error(
        fence_cli(worker_env, "outbox", "requeue", str(broken), "--dead"), 2, "not both"
    )
    assert_one_line_error(
        fence_cli(worker_env, "outbox", "requeue", str(broken), "--key", key), 2, "--key"
    )
    assert_one_line_error(fence_cli(worker_env, "outbox", "requeue", "seven"), 2, "seven")
    # An unreachable database: one line, no traceback.
    down = {**worker_env, "FENCE_T_DB": UNREACHABLE_PG}
    assert_one_line_error(fence_cli(down, "outbox", "ls"), 1, "database error")


def test_requeue_dead_takes_every_dead_effect_of_a_key(
    fence_store: Store, worker_env: dict[str, str], prefix: str
) -> None:
    fence_store.create_schema()
    key = _job_with_effects(fence_store, f"{prefix}.t", "a", "b", "c")
    other = _job_with_effects(fence_store, f"{prefix}.t", "a")
    a, b = _kill(fence_store, key, "a"), _kill(fence_store, key, "b")
    other_a = _kill(fence_store, other, "a")

    out = ok(fence_cli(worker_env, "outbox", "requeue", "--dead", "--key", key))
    assert out.strip() == f"requeued 2 outbox effect(s): {min(a, b)}, {max(a, b)}"
    assert {r.name: r.status for r in fence_store.outbox_rows.rows(key=key)} == {
        "a": "pending",
        "b": "pending",
        "c": "pending",
    }
    assert _row(fence_store, other, "a").status == "dead"  # another key's: untouched
    assert fence_store.outbox_rows.statuses([other_a]) == {other_a: "dead"}
    again = ok(fence_cli(worker_env, "outbox", "requeue", "--dead", "--key", key))
    assert again.strip() == "requeued 0 outbox effects"
    if fence_store.dialect == "sqlite":  # this test's own file: every dead effect is ours
        everything = ok(fence_cli(worker_env, "outbox", "requeue", "--dead"))
        assert everything.strip() == f"requeued 1 outbox effect(s): {other_a}"
        assert _row(fence_store, other, "a").status == "pending"


# -- the delivery's backoff ------------------------------------------------------------------------


@pytest.fixture
def outbox_app(db_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery(f"backoff-{prefix}", set_as_current=False)
    app.conf.update(
        fence_database_url=db_url,
        fence_redis_url=REDIS_URL,
        fence_key_prefix=prefix,
        fence_max_attempts=2,  # the tasks' budget: not the outbox's
    )
    yield app
    app.close()


def _failing(outbox: Outbox, name: str) -> list[str]:
    calls: list[str] = []

    def handler(payload: Any, *, idempotency_key: str) -> None:
        calls.append(idempotency_key)
        raise ConnectionError("provider down")

    outbox.register(name, handler)
    return calls


def test_backoff_grows_and_the_effect_stays_pending_for_the_configured_attempts(
    outbox_app: Celery, store: Store
) -> None:
    outbox_app.conf.update(
        fence_outbox_max_attempts=6, fence_outbox_backoff=0.02, fence_outbox_backoff_max=0.16
    )
    config = FenceConfig.from_app(outbox_app)
    key = _job_with_effects(store, "t", "mail")
    outbox = Outbox(outbox_app)
    calls = _failing(outbox, "mail")
    waits: list[float] = []
    for attempt in range(1, 6):
        reports: list[DeliveryReport] = []

        def failed_once(got: list[DeliveryReport] = reports) -> bool:
            got.append(outbox.deliver(key=key))
            return got[-1].failed == 1

        wait_until(failed_once, 10, what=f"failed delivery {attempt}")
        wait = reports[-1].retry_in
        assert wait is not None and reports[-1].dead == 0
        row = _row(store, key, "mail")
        assert (row.status, row.attempts, len(calls)) == ("pending", attempt, attempt)
        assert _due_in(store, row) <= wait + 0.001  # stored: due after that wait
        top = retry_ceiling(attempt, config)
        assert top / 2 <= wait <= top, (attempt, wait, top)
        waits.append(wait)
    # Equal jitter: each wait is at least half its ceiling, so they grow until the cap (0.16 s).
    assert waits[2] >= waits[0] and waits[3] >= waits[1] and waits[4] >= 0.08
    wait_until(
        lambda: (outbox.deliver(key=key), _row(store, key, "mail").status == "dead")[1],
        10,
        what="dead after the 6th delivery",
    )
    assert (_row(store, key, "mail").attempts, len(calls)) == (6, 6)


def test_the_defaults_keep_a_failing_effect_pending_for_hours(
    outbox_app: Celery, store: Store
) -> None:
    # At the defaults (only the tasks' fence_max_attempts=2 set), five failed deliveries — the
    # old dead point — leave the effect pending, due ever later; the clock is moved by hand.
    key = _job_with_effects(store, "t", "mail")
    outbox = Outbox(outbox_app)
    calls = _failing(outbox, "mail")
    config = FenceConfig.from_app(outbox_app)
    assert outbox.max_attempts == config.outbox_max_attempts == 20
    low, high = dead_after(config)
    assert low >= 5 * 3600 and high <= 12 * 3600
    for attempt in range(1, 6):
        report = outbox.deliver(key=key)
        assert (report.failed, report.dead) == (1, 0)
        row = _row(store, key, "mail")
        assert (row.status, row.attempts, len(calls)) == ("pending", attempt, attempt)
        assert _due_in(store, row) >= retry_ceiling(attempt, config) / 2 - 1.0
        _make_due(store, row.id)
    assert retry_ceiling(5, config) == 160.0 and retry_ceiling(20, config) == 3600.0


def _aware(value: dt.datetime) -> dt.datetime:
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value


def _due_in(store: Store, row: OutboxRow) -> float:
    """Seconds until ``row`` is due, on the database's clock (PostgreSQL) or this host's."""
    now = dt.datetime.now(dt.timezone.utc)
    if store.dialect == "postgresql":
        with store.db.connect() as conn:
            now = conn.execute(sa.select(sa.func.now())).scalar_one()
    return (_aware(row.available_at) - _aware(now)).total_seconds()


def _make_due(store: Store, row_id: int) -> None:
    """Move time forward for one row: its next delivery is due now."""
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    with store.db.connect() as conn:
        conn.execute(
            outbox_table.update().where(outbox_table.c.id == row_id).values(available_at=past)
        )


@pytest.mark.parametrize(("backoff", "sent"), [(0.05, 1), (700.0, 0)])
def test_the_deliver_task_comes_back_only_for_a_retry_due_soon(
    db_url: str, prefix: str, store: Store, redis_client: redis.Redis, backoff: float, sent: int
) -> None:
    # A failed delivery due within RETRIGGER_MAX (300 s) is followed by a deliver message with
    # its countdown; one due later (700 s: 350-700 s) is left to the sweep, no message is held.
    queue = f"{prefix}:deliver"
    app = Celery(f"retrigger-{prefix}", set_as_current=False, broker=BROKER_URL)
    app.conf.update(
        fence_database_url=db_url,
        fence_redis_url=REDIS_URL,
        fence_key_prefix=prefix,
        fence_outbox_backoff=backoff,
        fence_outbox_backoff_max=max(backoff, 1.0),
        task_default_queue=queue,
    )
    try:
        key = _job_with_effects(store, "t", "mail")
        outbox = Outbox(app)
        calls = _failing(outbox, "mail")
        app.tasks[DELIVER_TASK](key=key)  # the task's body, run here
        assert len(calls) == 1 and _row(store, key, "mail").status == "pending"
        broker = redis.Redis.from_url(BROKER_URL)
        messages = [json.loads(m) for m in broker.lrange(queue, 0, -1)]
        broker.close()
        assert len(messages) == sent
        for message in messages:
            assert message["headers"]["task"] == DELIVER_TASK and message["headers"]["eta"]
    finally:
        delete_queues(app, [queue])
        app.close()
