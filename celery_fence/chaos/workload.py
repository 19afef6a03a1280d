"""The chaos workload: the Celery app the harness's workers run (``celery -A`` this module).

Configured only from ``CHAOS_*`` environment variables, which the harness sets for each scenario
(:func:`settings_from_env`). One fenced task, :data:`TASK_NAME`, and one outbox handler.

The workload writes a **ledger** of what really happened: one Redis list,
``<CHAOS_LEDGER_PREFIX>:events``, of JSON entries ``{"ev", "key", "gen", "attempt", "pid", "t"}``
(``t`` is wall-clock seconds, comparable with the store's transition times on the same machine):

- ``start``   a body started (after the store registered its generation);
- ``effect``  the body performed its side effect, inside ``self.fence.guard()``; ``t0`` is the
  time just before the guard was entered;
- ``call``    an external call to the provider (``outcome``: ok, timeout, error; ``idem``: the
  idempotency key sent; ``effect``: the effect name);
- ``tx``      the body entered its ``self.fence.transaction()`` block (``app_write``), before its
  write; ``tx_committed``: the block committed (``t0``: the time just before the block's commit
  began);
- ``outcome`` what the store answered this attempt (``outcome``: completed, stale, replayed,
  retry_scheduled, dead), from the fence's own signals in the worker, with the attempt's own
  generation and attempt id (never the row the store returned). With ``start`` (the attempt's
  generation, as the store registered it) this is the checker's witness: it compares the store's
  history with what each attempt tried and was told, not with itself;
- ``lost``    the attempt learnt it lost its lease (the fence's ``lease_lost`` signal);
- ``busy``    a delivery found the key's lease held by another attempt (``lease_busy``; with
  ``task``, the message's task id, as ``outcome`` entries have it);
- ``held``    a one-shot hold was consumed (``window``: in_block, after the body's write inside
  its block; after_block, after the block committed; after_commit, after the completion's commit
  and before the ack): the body waits there for the harness's ``go:<key>`` flag (the
  store-crash scenario crashes the database then);
- ``kill``    a one-shot fault flag was consumed and the process is about to SIGKILL itself
  (``window``: before_effect, before_commit, after_commit, or poison);
- ``overrun`` the body starts to overrun (it sleeps until the pool's hard time limit kills it);
- ``fail``    the body raises a transient error (``ConnectionError``) after its sleep;
- ``permanent`` the body raises ``PermanentError`` (input that can never succeed);
- ``regressed`` a claim got a generation the store had already seen (Redis lost its counter):
  the fence raised the counter and claimed again (its ``regressed`` log record).

Fault flags are the one-shot flags of :mod:`celery_fence.testing.faults`, under the ledger
prefix: ``kill:<window>:<key>`` is taken right before ``os.kill(os.getpid(), SIGKILL)``, so a
fault happens once even though the process dies; ``overrun:<key>``, ``fail:<key>`` and
``interrupt:<key>`` likewise (``mode="overrun"`` overruns on every run), and ``go:<key>`` lets a
body held inside its block go on. The after-commit window is a
:data:`celery_fence.signals.job_completed` receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import logging
import os
import signal
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import redis
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from celery_fence import FencedTask, PermanentError
from celery_fence import signals as fence_signals
from celery_fence.chaos import APP_ROWS, BESIDE_FORMS, CHARGE, EXPORT_ROWS, NOTIFY, TASK_NAME
from celery_fence.chaos.arms import (
    AsyncEndingsTask,
    UnfencedStepsTask,
    UnfencedTask,
    UnsettledTask,
    UnwatchedTask,
)
from celery_fence.chaos.workload_sql import beside_statement
from celery_fence.errors import ConfigurationError
from celery_fence.ops.outbox import Outbox, idempotency_key
from celery_fence.store import Store, queries
from celery_fence.testing import faults

#: Environment variables the harness sets (all strings) and their defaults.
ENV_DEFAULTS = {
    "CHAOS_BROKER_URL": "redis://127.0.0.1:6379/2",
    "CHAOS_BACKEND_URL": "redis://127.0.0.1:6379/1",
    "CHAOS_REDIS_URL": "redis://127.0.0.1:6379/1",
    "CHAOS_LEDGER_URL": "redis://127.0.0.1:6379/1",
    "CHAOS_DATABASE_URL": "sqlite:///celery_fence_chaos.sqlite3",
    "CHAOS_PREFIX": "chaos",
    "CHAOS_LEDGER_PREFIX": "chaos-ledger",
    "CHAOS_QUEUE": "chaos",
    "CHAOS_TTL": "1.5",
    "CHAOS_MAX_ATTEMPTS": "3",
    "CHAOS_UNFENCED": "0",
    "CHAOS_UNSETTLED": "0",
    "CHAOS_RERUN_FINISHED": "0",
    "CHAOS_UNWATCHED": "0",
    "CHAOS_UNFENCED_STEPS": "0",
    "CHAOS_ASYNC_ENDINGS": "0",
    "CHAOS_RENEW_INTERVAL": "",  # empty: ttl / 3 (the misconfig scenario sets an invalid one)
    "CHAOS_PROVIDER_URL": "",
    "CHAOS_REMOTE_TIMEOUT": "0.5",
    "CHAOS_RECOVER_INTERVAL": "0",  # "default": the fence's own (options.WORKERS_RECOVER)
}


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {name: env.get(name) or default for name, default in ENV_DEFAULTS.items()}


def make_app(s: Mapping[str, str]) -> Celery:
    """The workload's Celery app for the settings ``s`` (the ``CHAOS_*`` names)."""
    ttl = float(s["CHAOS_TTL"])
    app = Celery("celery_fence_chaos", broker=s["CHAOS_BROKER_URL"], backend=s["CHAOS_BACKEND_URL"])
    app.conf.update(
        task_default_queue=s["CHAOS_QUEUE"],
        worker_prefetch_multiplier=1,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        fence_redis_url=s["CHAOS_REDIS_URL"],
        fence_database_url=s["CHAOS_DATABASE_URL"],
        fence_key_prefix=s["CHAOS_PREFIX"],
        fence_lease_ttl=ttl,
        fence_renew_interval=float(s["CHAOS_RENEW_INTERVAL"] or ttl / 3),
        fence_max_attempts=int(s["CHAOS_MAX_ATTEMPTS"]),
        fence_retry_backoff=0.1,
        fence_retry_backoff_max=0.5,
        # the outbox's deliveries retried at the same pace (its defaults span hours)
        fence_outbox_max_attempts=int(s["CHAOS_MAX_ATTEMPTS"]),
        fence_outbox_backoff=0.1,
        fence_outbox_backoff_max=0.5,
        # the harness retries on purpose, many times a minute: the budget must not delay it
        fence_retry_budget_floor=100_000,
        # The harness runs recovery itself, at the points each scenario names: the workers' own
        # recovery checks would re-send jobs in the middle of those windows (the store-crash
        # scenario's recovery phase raced them) and re-send the jobs the --unsettled and
        # --async-endings arms lose, hiding what those arms show. tests/acceptance/
        # test_takeover.py measures the workers' checks; so does the unique scenario
        # (options.WORKERS_RECOVER), at the fence's defaults.
        fence_recover_interval=None
        if s["CHAOS_RECOVER_INTERVAL"] == "default"
        else float(s["CHAOS_RECOVER_INTERVAL"]),
        # the scenarios' own tasks, on this app (a worker and beat import them): unique and beat,
        # the limited tasks of the group and rate scenarios
        imports=("celery_fence.chaos.workload_unique", "celery_fence.chaos.workload_limits"),
    )
    return app


S = settings_from_env()
app = make_app(S)
outbox = Outbox(app, claim_ttl=max(5.0, 4 * float(S["CHAOS_REMOTE_TIMEOUT"])))
ledger = redis.Redis.from_url(S["CHAOS_LEDGER_URL"])
LEDGER = S["CHAOS_LEDGER_PREFIX"]


def record(
    ev: str, key: str, gen: int | None = None, attempt: str | None = None, **extra: Any
) -> None:
    """Append one ledger entry (never payloads: key, generation, attempt, pid, time)."""
    entry: dict[str, Any] = {"ev": ev, "key": key, "gen": gen, "attempt": attempt}
    entry["pid"] = os.getpid()
    entry.update(extra)
    entry["t"] = time.time()
    ledger.rpush(f"{LEDGER}:events", json.dumps(entry))


#: How long an overrunning body sleeps at most (the hard time limit kills it long before).
OVERRUN_S = 60.0


def _kill_once(window: str, key: str, gen: int | None = None, attempt: str | None = None) -> None:
    if faults.take(ledger, LEDGER, "kill", window, key):
        record("kill", key, gen, attempt, window=window)
        os.kill(os.getpid(), signal.SIGKILL)


#: How long a held body waits at most for the harness's ``go`` flag.
HOLD_S = 60.0


def _hold_once(window: str, key: str, gen: int | None = None, attempt: str | None = None) -> None:
    """A one-shot hold (``hold:<window>:<key>``): record ``held``, then wait (at most
    :data:`HOLD_S`) for the harness's ``go:<key>`` flag."""
    if not faults.take(ledger, LEDGER, "hold", window, key):
        return
    record("held", key, gen, attempt, window=window)
    end = time.monotonic() + HOLD_S
    while time.monotonic() < end and not faults.take(ledger, LEDGER, "go", key):
        time.sleep(0.02)


def call_provider(path: str, idem: str, payload: Any, *, timeout: float) -> dict[str, Any]:
    """POST ``payload`` to the provider with an ``Idempotency-Key``; raise on timeout/errors."""
    url = urlsplit(S["CHAOS_PROVIDER_URL"])
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout)
    try:
        body = json.dumps(payload, sort_keys=True)
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Idempotency-Key": idem, "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    if response.status >= 500:
        raise ConnectionError(f"provider answered {response.status}")
    if response.status >= 400:
        raise PermanentError(f"provider refused the request ({response.status})")
    return dict(json.loads(data or b"{}"))


#: The registration's terminal-state term, as queries.sql's ``register`` writes it.
TERMINAL_TERM = "fence_jobs.status NOT IN ('completed', 'dead')\n    AND "


class RerunsFinished(FencedTask, fence_base=True):
    """The control arm of ``body re-runs after completion`` (``--rerun-finished``): this task's
    store registers a newer generation over a completed or dead job, as a registration without
    its ``status NOT IN (completed, dead)`` term would (the generation term stays). A
    redelivered message of a completed job then runs its body again."""

    def fence_backends(self) -> Any:
        backends = super().fence_backends()
        store: Store = backends.store
        register = store.queries["register"]
        if TERMINAL_TERM in register:  # this store's own statements, the term taken out
            loose = register.replace(TERMINAL_TERM, "", 1)
            store.queries = queries.Rendered({**store.queries, "register": loose})
        elif "NOT IN ('completed', 'dead')" in register:  # never run the arm unbroken silently
            raise RuntimeError("--rerun-finished: the registration's terminal term not found")
        return backends


def _base(s: Mapping[str, str]) -> type[FencedTask]:
    """The task base of the arm the settings ask for (the control arms: :mod:`.arms`)."""
    bases = [
        base
        for flag, base in (
            ("CHAOS_UNFENCED", UnfencedTask),
            ("CHAOS_UNSETTLED", UnsettledTask),
            ("CHAOS_RERUN_FINISHED", RerunsFinished),
            ("CHAOS_UNWATCHED", UnwatchedTask),
            ("CHAOS_UNFENCED_STEPS", UnfencedStepsTask),
            ("CHAOS_ASYNC_ENDINGS", AsyncEndingsTask),
        )
        if s[flag] == "1"
    ]
    if len(bases) <= 1:
        return bases[0] if bases else FencedTask
    return types.new_class("ControlArms", tuple(bases), {"fence_base": True})


_BASE = _base(S)


@app.task(base=_BASE, bind=True, name=TASK_NAME, fence_key=lambda key, **kw: key)
def op(
    self: Any,
    key: str,
    *,
    sleep: float = 0.0,
    check: bool = True,
    mode: str = "normal",
    remote: bool = False,
    notify: bool = True,
    app_write: bool = False,
    block_sleep: float = 0.0,
    hold_in_block: float = 0.0,
    via: str = "transaction",
    beside: str = "",
    payload: str = "",
    steps: int = 0,
    export_rows: int = 0,
    export_batch: int = 0,
) -> dict[str, Any]:
    """One logical operation. ``check=False``: no direct side effect, the body relies on the
    store alone (its result and its outbox row are what a stale attempt would write).
    ``notify=False``: no outbox effect either (the outbox's unique idempotency key would
    otherwise refuse a second completion on its own), so the result is the only thing written.
    ``app_write``: write one row to the app's table inside ``self.fence.transaction()``, after
    ``block_sleep`` seconds inside the block; then, with ``hold_in_block``, wait (at most that
    long) inside the block, after the write and before its commit, for the harness's ``go`` flag.
    ``via="binds"``: the same write through ``self.fence.session()`` of an ORM session that
    routes the app's table to an engine of its own by ``binds=`` (as Flask-SQLAlchemy's does);
    ``via="django"``: through Django's ORM inside ``self.fence.atomic()``;
    ``via="django-threads"``: two threads, each in a ``self.fence.atomic()`` block of its own
    (each sleeps ``block_sleep``, writes its row, and records ``tx_committed``).
    ``beside``: inside the block, after ``block_sleep`` and before the block's own write, a write
    on another connection of the store's database (committed there) in the text form named
    (:data:`~celery_fence.chaos.BESIDE_FORMS`): ledger ``beside_committed`` (``t0``: just
    before its COMMIT) or ``beside_refused``.
    ``payload``: only carried in the request (the refused-arg scenario puts a NUL in it).
    ``steps``: first run that many fenced steps (:func:`_run_steps`; a one-shot flag pauses one
    of them for ``block_sleep`` seconds).
    ``export_rows``: first export that many rows, ``export_batch`` at a time (:func:`_export`)."""
    fence = self.fence
    gen, attempt = fence.generation, fence.attempt_id
    record("start", key, gen, attempt)
    _kill_once("before_effect", key, gen, attempt)
    if steps:
        _run_steps(fence, key, gen, attempt, steps, block_sleep)
    if export_rows:
        _export(fence, key, gen, attempt, export_rows, export_batch)
    if mode == "overrun" or faults.take(ledger, LEDGER, "overrun", key):
        record("overrun", key, gen, attempt)
        sleep = OVERRUN_S  # the pool's hard time limit kills this process first
    end = time.monotonic() + sleep
    while time.monotonic() < end:
        time.sleep(0.02)
    if faults.take(ledger, LEDGER, "fail", key):
        record("fail", key, gen, attempt)
        raise ConnectionError("chaos: a transient failure")
    if faults.take(ledger, LEDGER, "interrupt", key):
        record("interrupt", key, gen, attempt)
        raise asyncio.CancelledError()  # a BaseException: not an Exception
    if mode == "permanent":
        record("permanent", key, gen, attempt)
        raise PermanentError("chaos: input that can never succeed")
    if mode == "kill":
        record("kill", key, gen, attempt, window="poison")
        os.kill(os.getpid(), signal.SIGKILL)
    if remote:
        idem = idempotency_key(key, CHARGE)
        path = f"/charges/{idem}"
        fence.check()
        try:
            call_provider(path, idem, {"key": key}, timeout=float(S["CHAOS_REMOTE_TIMEOUT"]))
        except TimeoutError:
            record("call", key, gen, attempt, effect=CHARGE, idem=idem, outcome="timeout")
            raise
        except Exception as exc:
            record("call", key, gen, attempt, effect=CHARGE, idem=idem, outcome="error")
            raise ConnectionError(f"provider call failed: {type(exc).__name__}") from None
        record("call", key, gen, attempt, effect=CHARGE, idem=idem, outcome="ok")
    if check:
        t0 = time.time()
        with fence.guard():
            record("effect", key, gen, attempt, t0=t0)
    if app_write and via == "django-threads":
        _django_threads(fence, key, gen, attempt, block_sleep)
    elif app_write:
        with _app_block(fence, via) as write:
            record("tx", key, gen, attempt)
            end = time.monotonic() + block_sleep
            while time.monotonic() < end:
                time.sleep(0.02)
            if beside:
                _write_beside(beside, key, gen, attempt)
            write({"key": key, "generation": gen, "attempt_id": attempt, "written_at": time.time()})
            _hold_once("in_block", key, gen, attempt)
            if hold_in_block:
                record("tx_written", key, gen, attempt)
                end = time.monotonic() + hold_in_block
                while time.monotonic() < end and not faults.take(ledger, LEDGER, "go", key):
                    time.sleep(0.02)
            t0 = time.time()  # the block's commit (fenced) starts when the block ends
        record("tx_committed", key, gen, attempt, t0=t0)
        _hold_once("after_block", key, gen, attempt)
    _kill_once("before_commit", key, gen, attempt)
    if notify:
        fence.effects.add(NOTIFY, {"key": key})
    return {"key": key, "generation": gen, "attempt_id": attempt}


def _run_steps(fence: Any, key: str, gen: int, attempt: str, steps: int, pause_s: float) -> None:
    """Steps ``step1`` .. ``step<steps>`` through ``fence.run_step()``; each records ``step``
    when its body starts, an unguarded ``effect`` (an external call), writes one app-table row in
    the step's transaction, and, taking the one-shot flag ``pause:step:<n>:<key>``, records
    ``step_paused`` and stays inside the step ``pause_s`` seconds (the harness SIGSTOPs it there).
    ``step_committed`` once ``run_step`` returned (stored, or replayed)."""
    for n in range(1, steps + 1):
        fence.run_step(f"step{n}", _step, fence, key, gen, attempt, n, pause_s)
        record("step_committed", key, gen, attempt, step=n)


def _export(fence: Any, key: str, gen: int, attempt: str, rows: int, batch: int) -> None:
    """Export rows ``0..rows-1`` from the job's checkpoint on: each batch (ledger ``batch``, with
    its ``start`` and ``end``) and the checkpoint after it in one fenced block."""
    start = int((fence.progress or {}).get("next", 0))
    while start < rows:
        end = min(start + batch, rows)
        record("batch", key, gen, attempt, start=start, end=end)
        time.sleep(0.05)  # the batch's own work (a read of the source, say)
        with fence.transaction() as conn:
            values = [{"key": key, "row_id": n} for n in range(start, end)]
            conn.execute(EXPORT_ROWS.insert(), values)
            fence.checkpoint({"next": end})
        start = end


def _step(fence: Any, key: str, gen: int, attempt: str, n: int, pause_s: float) -> dict[str, int]:
    record("step", key, gen, attempt, step=n)
    record("effect", key, gen, attempt, t0=time.time(), step=n)
    with fence.transaction() as conn:  # the step's own transaction (fenced steps)
        row = {"key": key, "generation": gen, "attempt_id": attempt, "written_at": time.time()}
        conn.execute(APP_ROWS.insert().values(**row))
    if faults.take(ledger, LEDGER, "pause", "step", str(n), key):
        record("step_paused", key, gen, attempt, step=n)
        end = time.monotonic() + pause_s
        while time.monotonic() < end:
            time.sleep(0.02)
    return {"step": n, "generation": gen}


@contextlib.contextmanager
def _app_block(fence: Any, via: str) -> Iterator[Callable[[dict[str, Any]], Any]]:
    """The fenced block the app writes its row in, as a ``write(row)`` callable:
    ``fence.transaction()``; (``binds``) an ORM session whose ``binds=`` send the app's table to
    an engine of the app's own; (``django``) Django's ORM in ``fence.atomic()``."""
    if via == "transaction":
        with fence.transaction() as conn:
            yield lambda row: conn.execute(APP_ROWS.insert().values(**row))
    elif via == "binds":
        with fence.session(_routed_sessions()) as session:
            yield lambda row: session.execute(APP_ROWS.insert().values(**row))
    elif via == "django":
        model = _django_model()
        with fence.atomic():
            yield lambda row: model.objects.create(**row)
    else:
        raise ValueError(f"unknown app-write block {via!r}")


@functools.cache
def _beside_engine() -> sa.Engine:
    """The app's other engine on the store's database: its connections are not the block's."""
    return sa.create_engine(S["CHAOS_DATABASE_URL"])


def _write_beside(form: str, key: str, gen: int, attempt: str) -> None:
    if form not in BESIDE_FORMS:
        raise ValueError(f"unknown beside form {form!r}: one of {', '.join(BESIDE_FORMS)}")
    statement = beside_statement(form, key, gen, attempt, time.time())
    t0 = time.time()
    try:
        with _beside_engine().begin() as conn:
            conn.exec_driver_sql(statement)
            t0 = time.time()  # just before the COMMIT
    except ConfigurationError:  # the fence refused the write beside its block
        record("beside_refused", key, gen, attempt, form=form)
        return
    record("beside_committed", key, gen, attempt, t0=t0, form=form)


def _django_threads(fence: Any, key: str, gen: int, attempt: str, block_sleep: float) -> None:
    """Two threads of one attempt, each writing its row in a ``fence.atomic()`` block of its
    own: each outermost block on each connection must be fenced (issue 31 item 2)."""
    import threading

    from django.db import connection

    model = _django_model()
    errors: list[BaseException] = []
    first_inside = threading.Event()  # the second thread opens its block once the first is in

    def one(n: int) -> None:
        try:
            if n == 2:
                first_inside.wait(timeout=30)
            with fence.atomic():
                record("tx", key, gen, attempt, thread=n)
                first_inside.set()
                end = time.monotonic() + block_sleep
                while time.monotonic() < end:
                    time.sleep(0.02)
                model.objects.create(
                    key=key, generation=gen, attempt_id=attempt, written_at=time.time()
                )
                t0 = time.time()
            record("tx_committed", key, gen, attempt, t0=t0, thread=n)
        except BaseException as exc:  # raised again in the body's thread
            errors.append(exc)
        finally:
            first_inside.set()
            connection.close()  # this thread's own Django connection

    threads = [threading.Thread(target=one, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@functools.cache
def _django_model() -> Any:
    """The app's table as a Django model, on a Django configured here for the store's database
    (``DATABASES["default"]``), as a Django project's worker has it."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DATABASES={"default": _django_database(S["CHAOS_DATABASE_URL"])},
            INSTALLED_APPS=[],
            USE_TZ=True,
        )
        django.setup()
    from django.db import models

    class AppRow(models.Model):
        key = models.CharField(max_length=200)
        generation = models.BigIntegerField()
        attempt_id = models.CharField(max_length=64)
        written_at = models.FloatField()

        class Meta:
            app_label = "celery_fence_chaos"
            db_table = APP_ROWS.name
            managed = False

    return AppRow


def _django_database(url: str) -> dict[str, Any]:
    """``DATABASES["default"]`` for an SQLAlchemy URL of the store (PostgreSQL or a file)."""
    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": u.database}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": u.database,
        "USER": u.username or "",
        "PASSWORD": u.password or "",
        "HOST": u.host or "",
        "PORT": str(u.port or ""),
    }


@functools.cache
def _routed_sessions() -> sessionmaker[Session]:
    """A session factory as a Flask-SQLAlchemy app has one: the app's table bound, by
    ``binds=``, to an engine of the app's own on the store's database."""
    return sessionmaker(binds={APP_ROWS: sa.create_engine(S["CHAOS_DATABASE_URL"])})


@outbox.handler(NOTIFY)
def notify(payload: Any, *, idempotency_key: str) -> None:
    key = str(payload["key"])
    try:
        call_provider(f"/notify/{idempotency_key}", idempotency_key, payload, timeout=5.0)
    except Exception:
        record("call", key, effect=NOTIFY, idem=idempotency_key, outcome="error")
        raise
    record("call", key, effect=NOTIFY, idem=idempotency_key, outcome="ok")


def _kill_after_commit(sender: Any = None, key: str = "", **kw: Any) -> None:
    _kill_once("after_commit", key, kw.get("generation"), kw.get("attempt_id"))
    _hold_once("after_commit", key, kw.get("generation"), kw.get("attempt_id"))


def _task_id() -> str | None:
    """The Celery task id of the message being run on this thread (None off a task's thread,
    e.g. the renewal thread)."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    return getattr(request, "id", None)


def _outcome(outcome: str) -> Any:
    """A receiver that records what the store answered the attempt (its own generation)."""

    def receiver(sender: Any = None, key: str = "", **kw: Any) -> None:
        # the attempt's own claim (the settle step's attempt), not a row the store returned
        record(
            "outcome",
            key,
            kw.get("generation"),
            kw.get("attempt_id"),
            outcome=outcome,
            task=_task_id(),
        )

    return receiver


def _lost(sender: Any = None, key: str = "", **kw: Any) -> None:
    """The attempt learnt it lost its lease (the renewal thread, or a check in the body)."""
    record("lost", key, kw.get("generation"), kw.get("attempt_id"))


def _busy(sender: Any = None, key: str = "", **kw: Any) -> None:
    """A delivery found the key's lease held by another attempt (rescheduled)."""
    record("busy", key, kw.get("generation"), kw.get("attempt_id"), task=_task_id())


class _Regressions(logging.Handler):
    """Records the fence's regression branch (its ``action="regressed"`` log record)."""

    def emit(self, log: logging.LogRecord) -> None:
        if getattr(log, "action", None) == "regressed":
            record(
                "regressed",
                str(getattr(log, "fence_key", "")),
                getattr(log, "generation", None),
                getattr(log, "attempt_id", None),
            )


logging.getLogger("celery_fence").addHandler(_Regressions(logging.WARNING))

for _signal, _name in (
    (fence_signals.job_completed, "completed"),
    (fence_signals.stale_rejected, "stale"),
    (fence_signals.job_replayed, "replayed"),
    (fence_signals.job_retry_scheduled, "retry_scheduled"),
    (fence_signals.job_dead, "dead"),
):
    _signal.connect(_outcome(_name), weak=False)
fence_signals.job_completed.connect(_kill_after_commit, weak=False)  # after its outcome entry
fence_signals.lease_lost.connect(_lost, weak=False)
fence_signals.lease_busy.connect(_busy, weak=False)
