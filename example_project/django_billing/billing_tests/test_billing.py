"""The billing example under pytest-django, with celery-fence's plugin: real workers on the test
database, a worker paused before and inside ``self.fence.atomic()``, and the unsafe plain
``transaction.atomic()`` caught by the test's own check of the invoice row."""

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from billing.models import Invoice
from billing.tasks import bill_invoice, bill_invoice_unsafe
from django.db import connection

from celery_fence.testing.chaos import ConvergenceError

# the workers commit on their own connections: the test must not hold them in a transaction
pytestmark = pytest.mark.django_db(transaction=True)


def billed_by_the_converged_attempt(invoice_id):
    """The user's check: the invoice row holds the write of the attempt the fence kept."""

    def invoice_row(job):
        inv = Invoice.objects.get(pk=invoice_id)
        assert (inv.billed_generation, inv.billed_attempt) == (job.generation, job.attempt_id), (
            f"invoice {invoice_id} was billed by generation {inv.billed_generation}, "
            f"the fence kept generation {job.generation}"
        )
        return inv.total_cents == 1749

    return invoice_row


@pytest.mark.parametrize("window", ["pause", "pause-inside-block"])
def test_a_stale_worker_never_lands_its_invoice_write(fence_chaos, fence_store, window):
    inv = Invoice.objects.create(customer="acme")
    key = f"invoice:{inv.pk}"

    injection = fence_chaos.inject(window, bill_invoice.s(inv.pk))

    fence_chaos.assert_converged(key, check=billed_by_the_converged_attempt(inv.pk))
    completed = [t for t in fence_store.transitions.history(key) if t.action == "completed"]
    took = completed[0].at.timestamp() - injection.started
    assert took < 8 * fence_chaos.env.lease_ttl, f"the newer attempt completed after {took:.1f}s"
    # and the stale worker's next task runs on a usable connection (the server may have ended
    # the one it held while paused).
    a, _ = fence_chaos.workers
    following = Invoice.objects.create(customer="globex")
    billed = bill_invoice.apply_async((following.pk,), queue=a.queue).get(timeout=30)
    assert billed["total_cents"] == 30000


def test_a_plain_transaction_atomic_lets_the_stale_write_land(fence_chaos, fence_store):
    inv = Invoice.objects.create(customer="acme")
    key = f"invoice-unsafe:{inv.pk}"

    fence_chaos.inject("pause", bill_invoice_unsafe.s(inv.pk))

    with pytest.raises(ConvergenceError, match="invoice_row failed"):
        fence_chaos.assert_converged(key, check=billed_by_the_converged_attempt(inv.pk))

    # and the workers said so: each attempt's write outside any fenced block is in the job's
    # history (fence_unfenced_writes="warn": flagged, not refused), naming Django's connection
    # and the table.
    def flagged():
        return [t for t in fence_store.transitions.history(key) if t.action == "unfenced_write"]

    wait_for(lambda: len(flagged()) >= 2, 30, "both attempts' unfenced_write transitions")
    for transition in flagged():
        assert "Django's 'default' database connection" in transition.reason
        assert "billing_invoice" in transition.reason


def messages(response):
    return [str(m) for m in response.context["messages"]]


def wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {seconds}s waiting for {what}"
        time.sleep(0.1)


HERE = Path(__file__).resolve().parent.parent
#: The development database's tables the example writes: the fence's and the invoices.
DEVELOPMENT_TABLES = ("billing_invoice", "fence_jobs", "fence_transitions", "fence_outbox")


def _on_postgresql(settings):
    return settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"


def _pg(dbname):
    import psycopg

    return psycopg.connect(host="127.0.0.1", port=5432, user="postgres", dbname=dbname)


@pytest.fixture
def development_database(settings):
    """The development database (``BILLING_DB_NAME``, not the test database), opened: made with
    ``manage.py migrate`` as a developer would when it does not exist (and dropped afterwards),
    so the workers would have somewhere to write if they were pointed at it. Yields a function
    that reads its tables' row counts and the fence keys it holds."""
    name = settings.BILLING_DEVELOPMENT_DATABASE
    assert name != settings.DATABASES["default"]["NAME"]  # not the test database
    postgresql = _on_postgresql(settings)
    created = False
    if postgresql:
        with _pg("postgres") as admin:
            admin.autocommit = True
            if (
                admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
                is None
            ):
                admin.execute(f'CREATE DATABASE "{name}"')
                created = True
    else:
        created = not Path(name).exists()
    env = {**os.environ, "BILLING_DB_NAME": name}
    migrate = [sys.executable, "-m", "django", "migrate", "--noinput"]
    done = subprocess.run(migrate, env=env, cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    def contents():
        if postgresql:
            with _pg(name) as conn:
                counts = {
                    t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                    for t in DEVELOPMENT_TABLES
                }
                keys = {row[0] for row in conn.execute("SELECT key FROM fence_jobs")}
        else:
            with sqlite3.connect(name) as conn:
                counts = {
                    t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                    for t in DEVELOPMENT_TABLES
                }
                keys = {row[0] for row in conn.execute("SELECT key FROM fence_jobs")}
        return counts, keys

    yield contents
    if created and postgresql:
        with _pg("postgres") as admin:
            admin.autocommit = True
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    elif created:
        Path(name).unlink(missing_ok=True)


def test_the_admin_shows_a_dead_job_and_requeues_it(
    fenced_worker, fence_store, admin_client, development_database
):
    """The admin, and the plugin's worker on pytest-django's test database: the development
    database, opened before and after, is left as it was."""
    development_before = development_database()
    # Given an invoice billed before it existed: the job ran out of attempts and is dead,
    fenced_worker.start()
    missing = 10_000 + Invoice.objects.count()
    key = f"invoice:{missing}"
    bill_invoice.delay(missing).get(timeout=30, propagate=False)
    assert fence_store.get(key).status == "dead"
    listed = admin_client.get("/admin/celery_fence/job/?status__exact=dead").content.decode()
    assert key in listed and "DoesNotExist" in listed  # its last error
    history = admin_client.get(f"/admin/celery_fence/job/{key}/change/").content.decode()
    assert "retry_scheduled" in history and "DoesNotExist" in history
    # when the invoice exists and the operator requeues the job from the admin,
    Invoice.objects.create(pk=missing, customer="globex")
    changelist = "/admin/celery_fence/job/"
    selected = {"_selected_action": [key]}
    requeued = admin_client.post(changelist, {"action": "requeue_dead", **selected}, follow=True)
    assert messages(requeued)[0].startswith(f"job {key}: requeued as")
    reasons = [(t.action, t.reason) for t in fence_store.transitions.history(key)]
    assert ("requeued", "requeued by admin user admin") in reasons  # who requeued it
    # then the worker bills it under the same key, in the test database,
    wait_for(lambda: fence_store.get(key).status == "completed", 30, "the requeued job")
    job = fence_store.get(key)
    assert job.result["database"] == connection.settings_dict["NAME"]
    # and the development database is as it was: no job, transition, outbox row or invoice more,
    # and not this key.
    development_after = development_database()
    assert development_after == development_before
    assert key not in development_after[1]
    inv = Invoice.objects.get(pk=missing)
    assert (inv.total_cents, inv.billed_generation) == (30000, job.generation)
    recover = {"action": "recover_stranded", **selected}
    recovered = admin_client.post(changelist, recover, follow=True)
    assert messages(recovered) == ["0 stranded job(s), 0 re-sent"]


def test_migrate_alone_makes_celery_fence_check_pass(settings):
    # Given the test database, made by manage.py migrate and nothing else,
    env = {**os.environ, "BILLING_DB_NAME": settings.DATABASES["default"]["NAME"]}
    here = Path(__file__).resolve().parent.parent

    def fence(*args):
        command = [sys.executable, "-m", "celery", "-A", "billing_project", "fence", *args]
        return subprocess.run(command, env=env, cwd=here, capture_output=True, text=True)

    # then celery fence check passes on it: the schema at the version init-db would make.
    check = fence("check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "schema current" in check.stdout
