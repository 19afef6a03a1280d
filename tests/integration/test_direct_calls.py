"""A fenced task run in the caller's own thread — a direct call ``task(...)``, ``.apply()``,
``task_always_eager`` — inside the caller's open SQLAlchemy transaction on the store's database,
and a pytest-django session that runs fenced tasks eagerly, then drops its test database.

(The Django ``transaction.atomic()`` caller: ``test_django_atomic.py``, which configures Django
for its process.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence import FencedTask
from celery_fence.errors import FenceEagerWarning, FenceError
from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from tests.support.env import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def app_table(store: Store) -> Iterator[tuple[sa.Engine, str]]:
    """The app's own engine on the store's database, and a table of its own there."""
    engine = sa.create_engine(store.url)
    table = f"t_orders_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (id VARCHAR(64) PRIMARY KEY, paid INTEGER)"))
    yield engine, table
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table}"))
    engine.dispose()


def _charge_task(db_url: str, prefix: str, table: str) -> Any:
    app = Celery(f"direct-{prefix}", broker="memory://", set_as_current=False)
    app.conf.update(
        fence_redis_url=REDIS_URL,
        fence_database_url=db_url,
        fence_key_prefix=prefix,
        fence_lease_ttl=30.0,
        fence_database_timeout=3.0,  # bounds the old deadlock's wait
    )

    @app.task(base=FencedTask, bind=True, fence_key=lambda order: f"charge:{order}", shared=False)
    def charge(self: Any, order: str) -> int:
        with self.fence.transaction() as conn:  # the app's row, written fenced
            conn.execute(sa.text(f"UPDATE {table} SET paid = paid + 1 WHERE id = :o"), {"o": order})
        return self.fence.generation

    return charge


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql", "psycopg3"], indirect=True)
def test_a_direct_call_inside_an_open_sqlalchemy_transaction_that_wrote_is_refused_at_once(
    store: Store,
    db_url: str,
    prefix: str,
    redis_client: redis.Redis,
    app_table: tuple[sa.Engine, str],
) -> None:
    engine, table = app_table
    charge = _charge_task(db_url, prefix, table)
    order = uuid.uuid4().hex[:8]
    key = f"charge:{order}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (:o, 0)"), {"o": order})
    # Given the caller's transaction on the store's database, which has written (here the
    # very row the task writes; on SQLite any write holds the whole database) ...
    started = time.monotonic()
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {table} SET paid = 0 WHERE id = :o"), {"o": order})
        # When the fenced task is called directly, or run eagerly, inside it
        with pytest.raises(FenceError, match="inside an open transaction") as refused:
            charge(order)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FenceEagerWarning)
            eager = charge.apply(args=(order,))
        assert isinstance(eager.result, FenceError)
    # Then both are refused at once (not after a lock or statement timeout), saying why, and
    # nothing was claimed or written: no job row (nothing for recovery to run later), no lease
    assert time.monotonic() - started < 2.5
    assert "SQLAlchemy transaction" in str(refused.value)
    assert store.get(key) is None
    assert LeaseStore(redis_client, prefix=prefix).remaining(key)[0] is None
    with engine.connect() as conn:
        paid = conn.execute(sa.text(f"SELECT paid FROM {table} WHERE id = :o"), {"o": order})
        assert paid.scalar() == 0
    # And after the caller's commit, the same call runs, fenced, once
    assert charge(order) == 1
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 1)


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql", "psycopg3"], indirect=True)
def test_a_direct_call_of_a_job_enqueued_in_the_same_open_transaction_is_refused_at_once(
    store: Store,
    db_url: str,
    prefix: str,
    redis_client: redis.Redis,
    app_table: tuple[sa.Engine, str],
) -> None:
    from celery_fence import enqueue

    engine, table = app_table
    charge = _charge_task(db_url, prefix, table)
    order = uuid.uuid4().hex[:8]
    key = f"charge:{order}"
    started = time.monotonic()
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (:o, 0)"), {"o": order})
        # Given the job's own row, written (pending) by enqueue() in the caller's transaction ...
        enqueue(conn, charge, args=(order,))
        # When the same job is called directly before that transaction commits
        with pytest.raises(FenceError, match="inside an open transaction"):
            charge(order)
    # Then it is refused at once (its registration would wait on its own uncommitted row until
    # the lock timeout), and the enqueued job is as enqueue() left it: pending, never claimed
    assert time.monotonic() - started < 2.5
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("pending", 0)
    assert LeaseStore(redis_client, prefix=prefix).remaining(key)[0] is None


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_direct_call_inside_a_read_only_sqlalchemy_transaction_runs(
    store: Store, db_url: str, prefix: str, app_table: tuple[sa.Engine, str]
) -> None:
    engine, table = app_table
    charge = _charge_task(db_url, prefix, table)
    order = uuid.uuid4().hex[:8]
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (:o, 0)"), {"o": order})
    # Given the caller's transaction that has only read: it holds nothing the fence waits on
    with engine.begin() as conn:
        conn.execute(sa.text(f"SELECT paid FROM {table} WHERE id = :o"), {"o": order})
        # Then the direct call runs inside it, fenced
        assert charge(order) == 1
    record = store.get(f"charge:{order}")
    assert record is not None and record.status == "completed"
    with engine.connect() as conn:
        paid = conn.execute(sa.text(f"SELECT paid FROM {table} WHERE id = :o"), {"o": order})
        assert paid.scalar() == 1


PYTEST_DJANGO_TESTS = """
import warnings

import pytest
from billing.models import Invoice
from billing.tasks import bill_invoice

from celery_fence import FenceError
from celery_fence.errors import FenceEagerWarning


@pytest.mark.django_db
def test_refused_in_the_test_transaction():
    invoice = Invoice.objects.create(customer="acme")
    with pytest.raises(FenceError, match="pytest-django"):
        bill_invoice(invoice.pk)


@pytest.mark.django_db(transaction=True)
def test_runs_when_the_test_commits():
    invoice = Invoice.objects.create(customer="acme")
    assert bill_invoice(invoice.pk)["total_cents"] == 1749
    with pytest.warns(FenceEagerWarning):
        assert bill_invoice.apply(args=(invoice.pk,)).get()["total_cents"] == 1749
"""


def test_pytest_django_runs_fenced_tasks_directly_and_drops_its_test_database(
    tmp_path: Path, prefix: str
) -> None:
    # Given a pytest-django session of the billing example (PostgreSQL, the fence store in
    # DATABASES["default"]) whose tests call a fenced task directly: one inside pytest-django's
    # test transaction, one in a test that commits (eagerly too) ...
    project = ROOT / "example_project" / "django_billing"
    tests = tmp_path / "direct_tests"
    tests.mkdir()
    (tests / "test_direct.py").write_text(PYTEST_DJANGO_TESTS)
    dev_db = f"billing_direct_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(project), str(ROOT)]),
        "BILLING_DB_NAME": dev_db,
        "BILLING_FENCE_REDIS_URL": REDIS_URL,
        "BILLING_BROKER_URL": "memory://",
        "BILLING_RESULT_BACKEND": "cache+memory://",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(project / "pytest.ini"),
            "--rootdir",
            str(project),
            str(tests),
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    # Then the first is refused at once, the second runs, and the session ends cleanly: the test
    # database was dropped (no "being accessed by other users": the store closed its connections)
    output = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, output
    assert re.search(r"\b2 passed\b", proc.stdout), output
    assert "error" not in proc.stdout.lower(), output
