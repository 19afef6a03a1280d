"""``celery_fence.contrib.django.enqueue(task, ...)`` in the billing example, with a real worker
on pytest-django's test database: an invoice and its billing job commit together (billed once),
roll back together (nothing stored, nothing sent), and a rolled-back savepoint takes its job with
it."""

import time

import pytest
import redis
from billing.invoices import open_invoice
from billing.models import Invoice
from billing.tasks import bill_invoice
from django.db import connection, transaction

from celery_fence import ConfigurationError, FencedTask
from celery_fence.contrib.django import enqueue

pytestmark = pytest.mark.django_db(transaction=True)


def queued(fence_env):
    """Messages waiting in the test's queue (the Redis broker's list)."""
    return redis.Redis.from_url(fence_env.app.conf.broker_url).llen(fence_env.queue)


def wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {seconds}s waiting for {what}"
        time.sleep(0.1)


def test_a_committed_invoice_is_billed_once_a_rolled_back_one_leaves_nothing(
    fence_env, fenced_worker, fence_store
):
    # Given a transaction that rolls back after its invoice and its job ...
    with pytest.raises(RuntimeError), transaction.atomic():
        dropped = Invoice.objects.create(customer="acme")
        assert enqueue(bill_invoice, args=(dropped.pk,)).created
        raise RuntimeError("the request failed")
    # Then it left no invoice, no job row and no message (SQLite may reuse its primary key)
    assert not Invoice.objects.filter(pk=dropped.pk).exists()
    assert fence_store.get(f"invoice:{dropped.pk}") is None and queued(fence_env) == 0

    # Given a savepoint rolled back inside a committed one
    with transaction.atomic():
        kept = Invoice.objects.create(customer="acme")
        job = enqueue(bill_invoice, args=(kept.pk,))
        with pytest.raises(RuntimeError), transaction.atomic():
            inner = enqueue(bill_invoice, args=(kept.pk + 1000,))
            assert inner.created
            raise RuntimeError("the nested part failed")
        assert queued(fence_env) == 0  # nothing is sent before the commit
    # Then the savepoint's job is gone with it; the commit sent its own job, once
    assert fence_store.get(f"invoice:{kept.pk + 1000}") is None
    assert queued(fence_env) == 1
    record = fence_store.get(f"invoice:{kept.pk}")
    assert (record.status, record.generation, record.request["id"]) == ("pending", 0, job.task_id)

    # When a worker runs, the committed invoice is billed once, by the job's first attempt
    fenced_worker.start()
    key = f"invoice:{kept.pk}"
    wait_for(lambda: fence_store.get(key).status == "completed", 30, "the billing job")
    claims = [t for t in fence_store.transitions.history(key) if t.action == "claimed"]
    assert len(claims) == 1 and fence_store.get(key).generation == 1
    assert Invoice.objects.get(pk=kept.pk).total_cents == 1749
    assert job.async_result.get(timeout=10)["database"] == connection.settings_dict["NAME"]

    # And the same key enqueued again is the same job: nothing written, nothing sent
    with transaction.atomic():
        again = enqueue(bill_invoice, args=(kept.pk,))
    assert (again.created, again.status, again.task_id) == (False, "completed", job.task_id)
    assert queued(fence_env) == 0


def test_open_invoice_commits_the_invoice_with_its_job(fence_env, fenced_worker, fence_store):
    fenced_worker.start()
    inv = open_invoice("globex")
    key = f"invoice:{inv.pk}"
    wait_for(lambda: fence_store.get(key).status == "completed", 30, "the billing job")
    assert Invoice.objects.get(pk=inv.pk).total_cents == 30000


def test_outside_atomic_or_on_another_database_is_refused(fence_env, fence_store, tmp_path):
    # autocommit: the ORM's writes are already committed, the job could not commit with them
    with pytest.raises(ConfigurationError, match=r"transaction\.atomic"):
        enqueue(bill_invoice, args=(1,))
    assert fence_store.get("invoice:1") is None

    # a task whose store is not Django's database: its row could not be in the transaction
    @fence_env.app.task(
        base=FencedTask,
        name="billing_tests.elsewhere",
        fence_database_url=f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}",
    )
    def elsewhere():
        pass

    with transaction.atomic(), pytest.raises(ConfigurationError, match="not the fence store's"):
        enqueue(elsewhere)


def test_the_admin_marks_and_filters_never_claimed_jobs(fence_env, fence_store, admin_client):
    # Given an invoice enqueued and no worker running, and a job a worker has claimed
    waiting = open_invoice("acme")
    claimed = f"invoice:{waiting.pk + 1}"
    fence_store.register(claimed, generation=1, attempt_id="a1", task_name=bill_invoice.name)
    # Then the admin shows the enqueued one as never claimed, and its filter lists only it
    listed = admin_client.get("/admin/celery_fence/job/").content.decode()
    assert "pending (never claimed)" in listed and claimed in listed
    only = admin_client.get("/admin/celery_fence/job/?never_claimed=yes").content.decode()
    assert f"invoice:{waiting.pk}" in only and claimed not in only
