"""The Celery app that acceptance-test workers run (configured from FENCE_T_* variables).

The workload writes a ledger of what really happened to Redis, so tests assert on effects:
``<prefix>:runs:<key>``     one entry per body start ("<generation>:<attempt id>")
``<prefix>:effects:<key>``  one entry per side effect performed
One-shot fault flags (``<prefix>:kill:<window>:<key>``, ``<prefix>:hang:<key>``, ...;
:mod:`celery_fence.testing.faults`) are taken right before the fault, so a fault happens once even
though the process dies; gates (``<prefix>:unhang:<key>``, ``<prefix>:gate:<key>``,
``<prefix>:refuse_publish``) are flags of the same vocabulary that the workload only reads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import redis
from celery import Celery

from celery_fence import FencedTask, PermanentError
from celery_fence import signals as fence_signals
from celery_fence.testing import faults

E = os.environ
PREFIX = E.get("FENCE_T_PREFIX", "t")
app = Celery(
    "fence_tests",
    broker=E.get("FENCE_T_BROKER"),
    backend=E.get("FENCE_T_BACKEND", E.get("FENCE_T_BROKER")),
)
app.conf.update(
    task_default_queue=E.get("FENCE_T_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    # content types the worker takes (comma-separated: "json,pickle" for the re-send tests)
    accept_content=E.get("FENCE_T_ACCEPT", "json").split(","),
    fence_redis_url=E.get("FENCE_T_REDIS"),
    fence_database_url=E.get("FENCE_T_DB"),
    fence_key_prefix=PREFIX,
    fence_lease_ttl=float(E.get("FENCE_T_TTL", "2.0")),
    fence_renew_interval=float(E.get("FENCE_T_RENEW", "0.5")),
    fence_max_attempts=int(E.get("FENCE_T_MAX_ATTEMPTS", "5")),
    fence_retry_backoff=float(E.get("FENCE_T_BACKOFF", "0.2")),
    fence_retry_backoff_max=float(E.get("FENCE_T_BACKOFF_MAX", "1.0")),
    fence_retry_budget_floor=int(E.get("FENCE_T_BUDGET_FLOOR", "10")),
    fence_retry_budget_ratio=float(E.get("FENCE_T_BUDGET_RATIO", "0.2")),
    fence_retry_budget_window=float(E.get("FENCE_T_BUDGET_WINDOW", "60")),
    fence_generation_ttl=float(E.get("FENCE_T_GEN_TTL", "600")),
    fence_max_runtime=float(E["FENCE_T_MAX_RUNTIME"]) if E.get("FENCE_T_MAX_RUNTIME") else None,
    fence_metrics_port=int(E["FENCE_T_METRICS_PORT"]) if E.get("FENCE_T_METRICS_PORT") else None,
    # the worker's own recovery checks: off unless a test turns them on (the recovery tests
    # run `fence recover` themselves and assert what it re-sent)
    fence_recover_interval=(
        None  # "default": the library's default
        if E.get("FENCE_T_RECOVER_INTERVAL") == "default"
        else float(E.get("FENCE_T_RECOVER_INTERVAL", "0"))
    ),
    fence_recover_after=float(E["FENCE_T_RECOVER_AFTER"])
    if E.get("FENCE_T_RECOVER_AFTER")
    else None,
)
ledger = redis.Redis.from_url(E.get("FENCE_T_REDIS", "redis://127.0.0.1:6379/1"))

if E.get("FENCE_T_TOPIC") == "1":  # the queue bound to a topic exchange (RabbitMQ tests)
    from kombu import Exchange, Queue

    _topic = Exchange(f"{app.conf.task_default_queue}-topic", type="topic")
    app.conf.task_queues = [
        Queue(app.conf.task_default_queue, _topic, routing_key=f"{app.conf.task_default_queue}.#")
    ]
    app.conf.task_default_exchange = _topic.name
    app.conf.task_default_exchange_type = "topic"
    app.conf.task_default_routing_key = f"{app.conf.task_default_queue}.work"


def _takes_hang_flag(key: str) -> bool:
    """Take the flag ``<prefix>:hang:<key>`` (once): this body is to hang, a worker to kill or
    pause while it holds the key. Taken *before* the body's ``runs`` entry is pushed, so a test
    that saw the entry knows the flag is gone (a worker killed between the two would otherwise
    leave the flag to the rescuer, whose body would hang instead)."""
    return faults.take(ledger, PREFIX, "hang", key)


def _hang(key: str) -> None:
    """Hang (up to 60 s) until ``<prefix>:unhang:<key>`` is set."""
    end = time.monotonic() + 60
    while time.monotonic() < end and not faults.armed(ledger, PREFIX, "unhang", key):
        time.sleep(0.05)


def _kill_once(window: str, key: str) -> None:
    if faults.take(ledger, PREFIX, "kill", window, key):
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def work(
    self: Any,
    key: str,
    *,
    sleep: float = 0.0,
    check: bool = True,
    fail: str | None = None,
    marker: str | None = None,
) -> dict[str, Any]:
    fence = self.fence
    hang = _takes_hang_flag(key)
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{fence.generation}:{fence.attempt_id}")
    _kill_once("before_effect", key)
    if hang:
        _hang(key)
    end = time.monotonic() + sleep
    while time.monotonic() < end:
        time.sleep(0.02)
    if fail == "transient":
        failures = ledger.incr(f"{PREFIX}:failures:{key}")
        limit = int(ledger.get(f"{PREFIX}:fail_times:{key}") or 10**6)
        if failures <= limit:
            raise ConnectionError("simulated transient failure")
    if fail == "permanent":
        raise PermanentError("simulated permanent failure")
    if fail == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if check:
        with fence.guard():
            ledger.rpush(f"{PREFIX}:effects:{key}", f"{fence.generation}:{fence.attempt_id}")
    else:
        ledger.rpush(f"{PREFIX}:effects:{key}", f"{fence.generation}:{fence.attempt_id}")
    _kill_once("before_commit", key)
    result: dict[str, Any] = {
        "key": key,
        "generation": fence.generation,
        "attempt_id": fence.attempt_id,
    }
    if marker:
        result["marker"] = marker
    return result


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    fence_unique=lambda name, **kw: f"unique:{name}",
)
def unique_work(self: Any, name: str, *, sleep: float = 0.0) -> dict[str, Any]:
    """A unique job (its uniqueness key ``unique:<name>``, its job key the task id): one entry a
    body start in ``<prefix>:runs:<name>``; hangs on the ``hang`` flag of ``name``."""
    fence = self.fence
    hang = _takes_hang_flag(name)
    ledger.rpush(f"{PREFIX}:runs:{name}", f"{self.request.id}:{fence.generation}")
    if hang:
        _hang(name)
    end = time.monotonic() + sleep
    while time.monotonic() < end:
        time.sleep(0.02)
    with fence.guard():
        ledger.rpush(f"{PREFIX}:effects:{name}", f"{self.request.id}:{fence.generation}")
    return {"name": name, "generation": fence.generation}


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    fence_unique=True,
    fence_unique_states=("pending",),
)
def unique_while_queued(self: Any, name: str) -> str:
    """Unique while queued only (celery-once's ``unlock_before_run``): a started job gives its
    uniqueness key up."""
    return name


@app.task(shared=False, base=FencedTask, bind=True, fence_unique=True, fence_unique_period=0.5)
def unique_brief(self: Any, name: str) -> str:
    """Unique for half a second after each send, at most."""
    return name


@app.task(
    shared=False, base=FencedTask, bind=True, fence_unique=True, fence_unique_on_conflict="raise"
)
def unique_or_raise(self: Any, name: str) -> str:
    return name


from celery_fence.compat import QueueOnce, Singleton  # noqa: E402 - beside their tasks


@app.task(shared=False, base=QueueOnce, bind=True, once={"keys": ["a"], "timeout": 60})
def once_add(self: Any, a: int, b: int) -> int:
    """A celery-once task: unique on ``a``."""
    return a + b


@app.task(shared=False, base=QueueOnce, bind=True, once={"graceful": True})
def once_graceful(self: Any, a: int) -> int:
    return a


@app.task(shared=False, base=Singleton, bind=True, unique_on=["a"], lock_expiry=60)
def singleton_add(self: Any, a: int, b: int) -> int:
    """A celery-singleton task: unique on ``a``."""
    return a + b


@app.task(shared=False, base=Singleton, bind=True, raise_on_duplicate=True)
def singleton_strict(self: Any, a: int) -> int:
    return a


# -- the control arm of the unique-job tests: celery-once's own QueueOnce (a Redis TTL lock) ------
from celery_once import QueueOnce as UpstreamQueueOnce  # noqa: E402

ONCE_TTL = int(E.get("FENCE_T_ONCE_TTL", "30"))
app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {
        "url": E.get("FENCE_T_REDIS", "redis://127.0.0.1:6379/1"),
        "default_timeout": ONCE_TTL,
    },
}


@app.task(
    shared=False,
    base=UpstreamQueueOnce,
    bind=True,
    once={"graceful": True},
)
def once_control(self: Any, name: str) -> str:
    """``unique_work`` under celery-once's lock instead of a fenced job."""
    hang = _takes_hang_flag(name)
    ledger.rpush(f"{PREFIX}:runs:{name}", f"{self.request.id}:0")
    if hang:
        _hang(name)
    return name


def _kill_after_commit(sender: Any = None, key: str = "", **_: Any) -> None:
    _kill_once("after_commit", key)


fence_signals.job_completed.connect(_kill_after_commit, weak=False)


def _kill_after_dead(sender: Any = None, key: str = "", **_: Any) -> None:
    _kill_once("after_dead", key)


fence_signals.job_dead.connect(_kill_after_dead, weak=False)


@app.task(
    shared=False, base=FencedTask, bind=True, fence_key=lambda n: n
)  # returns an int: a user's mistake
def badly_keyed(self: Any, n: int) -> int:
    ledger.incr(f"{PREFIX}:badly_keyed_runs")
    return n


# -- transition records: payload-leak task, log redaction, signal recorder ----------
app.conf.fence_redact_celery_logs = E.get("FENCE_T_REDACT", "0") == "1"


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, *args, **kwargs: key)
def echo(self: Any, key: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Return its own arguments (payload-leak tests) after one line on the task logger."""
    from celery.utils.log import get_task_logger

    get_task_logger(__name__).info("echo body ran")
    return {"args": list(args), "kwargs": kwargs}


if E.get("FENCE_T_SIGNALS") == "1":
    import tests.support.signal_recorder  # noqa: F401 - records every fence signal to Redis


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key: key)
def nul_result(self: Any, key: str) -> dict[str, str]:
    ledger.incr(f"{PREFIX}:nul_runs:{key}")
    return {"text": "before\x00after"}  # valid JSON; PostgreSQL's jsonb refuses \u0000


# -- the settle step: Celery's own exits ---------------------------------------------
@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def overrun(self: Any, key: str, *, sleep: float, runs_overrunning: int = 1) -> dict[str, Any]:
    """Sleeps ``sleep`` seconds on its first ``runs_overrunning`` runs (time-limit tests)."""
    runs = ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    if runs <= runs_overrunning:
        end = time.monotonic() + sleep
        while time.monotonic() < end:
            time.sleep(0.02)
    return {"key": key, "generation": self.fence.generation}


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def control(self: Any, key: str, *, kind: str, countdown: float = 0.2) -> dict[str, Any]:
    """Raises Celery's own control flow from the body on its first run."""
    from celery.exceptions import Ignore, Reject

    runs = ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    if runs == 1:
        if kind == "ignore":
            raise Ignore()
        if kind == "reject":
            raise Reject("rejected by the test", requeue=False)
        if kind == "requeue":
            raise Reject("requeued by the test", requeue=True)
        if kind == "retry":
            raise self.retry(countdown=countdown)
    return {"key": key, "runs": runs}


@app.task(shared=False, base=FencedTask, bind=True)
def default_keyed(self: Any, label: str, *, fail_first: bool = False, sleep: float = 0.0) -> str:
    """Keyed by its Celery task id (the default); can fail transiently on its first run."""
    runs = ledger.rpush(
        f"{PREFIX}:runs:{label}", f"{self.fence.generation}:{self.fence.attempt_id}"
    )
    time.sleep(sleep)
    if fail_first and runs == 1:
        raise ConnectionError("simulated transient failure")
    return label


if E.get("FENCE_T_FAIL_RAISE") == "1":
    # Fault injection for the regression branch of the claim: raising the Redis counter above the
    # store's generation fails once per key (as it would during a failover).
    from celery_fence.leases.lease import LeaseStore

    _raise_generation = LeaseStore.raise_generation

    def _failing_raise(self: LeaseStore, key: str, floor: int) -> int:
        if faults.take(ledger, PREFIX, "fail_raise", key):
            raise redis.exceptions.ConnectionError("simulated failover during raise_generation")
        return _raise_generation(self, key, floor)

    LeaseStore.raise_generation = _failing_raise  # type: ignore[method-assign]

if E.get("FENCE_T_FAIL_PUBLISH") == "1":
    # The broker refuses one publish: the retry message of the ``control`` task, once per
    # ``<prefix>:fail_publish`` flag (kombu's OperationalError, as when the broker connection
    # drops for longer than the publish retry policy covers).
    from kombu import Producer
    from kombu.exceptions import OperationalError

    _publish = Producer.publish

    def _refusing_publish(self: Producer, body: Any, *args: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers") or {}
        if (
            headers.get("task") == control.name
            and headers.get("retries")
            and faults.take(ledger, PREFIX, "fail_publish")
        ):
            raise OperationalError("simulated: the broker refused the publish")
        resend = headers.get("retries") or headers.get("fence_resends")  # Celery's or the fence's
        if resend and faults.armed(ledger, PREFIX, "refuse_publish"):
            # A broker that refuses every re-send while the flag is set (each refusal counted).
            ledger.rpush(f"{PREFIX}:refused_publish", f"{time.time():.3f}")
            raise OperationalError("simulated: the broker refused the publish")
        return _publish(self, body, *args, **kwargs)

    Producer.publish = _refusing_publish  # type: ignore[method-assign]


# -- fenced app writes: the app's own tables, written through self.fence ------------
import sqlalchemy as sa  # noqa: E402
from sqlalchemy.dialects import postgresql as _pg  # noqa: E402
from sqlalchemy.dialects import sqlite as _sqlite  # noqa: E402
from sqlalchemy.orm import registry, sessionmaker  # noqa: E402

app_metadata = sa.MetaData()
#: One row per job (an upsert keyed by the job, as a report would be): the newer attempt's row
#: needs the same primary key a paused holder's uncommitted row holds.
app_reports = sa.Table(
    "t_app_reports",
    app_metadata,
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
)
#: Rows appended by every attempt (as invoice lines would be): any stale commit shows here.
app_lines = sa.Table(
    "t_app_lines",
    app_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
)


class AppLine:
    key: str
    generation: int
    attempt_id: str

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


registry().map_imperatively(AppLine, app_lines)
_app_engine: sa.Engine | None = None


def app_engine() -> sa.Engine:
    """The app's own engine on the store's database (``bind=`` and the ORM session use it);
    with ``FENCE_T_APP_PORT`` it connects to that port instead (a proxy in front of the same
    PostgreSQL), its URL still the store's."""
    global _app_engine
    if _app_engine is None:
        port = E.get("FENCE_T_APP_PORT")
        connect_args = {"port": int(port)} if port else {}
        _app_engine = sa.create_engine(E["FENCE_T_DB"], connect_args=connect_args)
    return _app_engine


_flask: Any = None


def flask_db() -> Any:
    """A Flask app and its Flask-SQLAlchemy ``db`` on the store's database, made once."""
    global _flask
    if _flask is None:
        from flask import Flask
        from flask_sqlalchemy import SQLAlchemy

        flask_app = Flask(__name__)
        flask_app.config["SQLALCHEMY_DATABASE_URI"] = E["FENCE_T_DB"]
        db = SQLAlchemy()
        db.init_app(flask_app)
        _flask = (flask_app, db)
    return _flask


@contextlib.contextmanager
def _routed_session(fence: Any, via: str) -> Iterator[Any]:
    """A fenced session whose own routing picks the engine: ``sessionmaker(binds=...)``, or
    Flask-SQLAlchemy's ``db.session`` (its ``get_bind`` sends everything to its engine)."""
    if via == "binds":
        with fence.session(sessionmaker(binds={AppLine: app_engine()})) as session:
            yield session
        return
    flask_app, db = flask_db()
    with flask_app.app_context(), fence.session(db.session):
        yield db.session  # the fenced session, inside the block


def _at(key: str, what: str, generation: int) -> None:
    ledger.rpush(f"{PREFIX}:at:{key}", f"{what}:{generation}")


def _sleep(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def write_app(
    self: Any,
    key: str,
    *,
    via: str = "conn",
    pause_before: float = 0.0,
    pause_inside: float = 0.0,
    gate: bool = False,
    fail_inside_once: bool = False,
) -> dict[str, Any]:
    """Do the work, then write this attempt's report row and two lines through the fence.

    The ledger ``<prefix>:at:<key>`` says where the body is (``worked``, ``inside``,
    ``committed``, each with the generation), so a test can SIGSTOP it there: ``pause_before``
    and ``pause_inside`` are seconds the body waits before the block and inside it after writing.
    ``gate``: wait (bounded) before the block until ``<prefix>:gate:<key>`` is set.
    ``via``: ``conn`` (``transaction()``), ``bind`` (``transaction(bind=app_engine)``),
    ``session`` (``session(sessionmaker(bind=app_engine))``), or a session routed by its own
    rules — ``binds`` (``sessionmaker(binds=...)``), ``flask`` (Flask-SQLAlchemy) — which
    marks ``inside`` before its first statement; ``beside``: Flask-SQLAlchemy's ``db.session``
    used directly inside ``transaction()`` (refused); ``outside``: the lines through a plain
    ``engine.begin()`` outside any block (flagged per ``fence_unfenced_writes``, from
    ``FENCE_T_UNFENCED_WRITES``), the report through the block.
    """
    fence = self.fence
    gen, attempt = fence.generation, fence.attempt_id
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{gen}:{attempt}")
    _at(key, "worked", gen)
    _sleep(pause_before)
    end = time.monotonic() + 30
    while gate and not faults.armed(ledger, PREFIX, "gate", key) and time.monotonic() < end:
        time.sleep(0.02)
    lines = [{"key": key, "generation": gen, "attempt_id": attempt} for _ in range(2)]
    if via in ("binds", "flask"):
        with _routed_session(fence, via) as session:
            session.add_all([AppLine(**line) for line in lines])  # flushed by the next statement
            _inside(key, gen, pause_inside, fail_inside_once)
            session.execute(_upsert(session.get_bind(), key, gen, attempt))
    elif via == "session":
        with fence.session(sessionmaker(bind=app_engine())) as session:
            session.add_all([AppLine(**line) for line in lines])
            session.flush()
            session.execute(_upsert(session.get_bind(), key, gen, attempt))
            _inside(key, gen, pause_inside, fail_inside_once)
    elif via == "outside":  # the most common mistake: a plain transaction, no fenced block
        with app_engine().begin() as conn:
            conn.execute(app_lines.insert(), lines)
        with fence.transaction() as conn:
            conn.execute(_upsert(conn, key, gen, attempt))
    elif via == "beside":  # the mistake: Flask-SQLAlchemy's db.session beside the block
        flask_app, db = flask_db()
        with flask_app.app_context(), fence.transaction() as conn:
            conn.execute(_upsert(conn, key, gen, attempt))
            db.session.add_all([AppLine(**line) for line in lines])
            db.session.commit()
    else:
        with fence.transaction(bind=app_engine() if via == "bind" else None) as conn:
            conn.execute(app_lines.insert(), lines)
            conn.execute(_upsert(conn, key, gen, attempt))
            _inside(key, gen, pause_inside, fail_inside_once)
    _at(key, "committed", gen)
    return {"key": key, "generation": gen, "attempt_id": attempt}


def _inside(key: str, gen: int, pause: float, fail_once: bool) -> None:
    _at(key, "inside", gen)
    _sleep(pause)
    if fail_once and faults.take(ledger, PREFIX, "fail_inside", key):
        raise ValueError("simulated failure inside the block")


def _upsert(bind: Any, key: str, gen: int, attempt: str) -> Any:
    dialect = _pg if bind.dialect.name == "postgresql" else _sqlite
    stmt = dialect.insert(app_reports).values(key=key, generation=gen, attempt_id=attempt)
    return stmt.on_conflict_do_update(
        index_elements=[app_reports.c.key],
        set_={"generation": stmt.excluded.generation, "attempt_id": stmt.excluded.attempt_id},
    )


app.conf.fence_lock_timeout = float(E.get("FENCE_T_LOCK_TIMEOUT", "5"))
app.conf.fence_unfenced_writes = E.get("FENCE_T_UNFENCED_WRITES", "warn")
app.conf.fence_database_timeout = float(E.get("FENCE_T_DB_TIMEOUT", "10"))
app.conf.fence_recover_pending_after = float(E.get("FENCE_T_RECOVER_PENDING_AFTER", "60"))


# -- exits that are not Exceptions: SystemExit, CancelledError, the gevent pool's time limit ------
@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def interrupted(self: Any, key: str, *, kind: str, sleep: float = 0.0) -> dict[str, Any]:
    """Ends its first run with a BaseException that is not an Exception: ``cancelled``
    (asyncio.CancelledError), ``exit`` (SystemExit), or ``sleep`` seconds for the pool to cut."""
    import asyncio

    runs = ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    if runs == 1:
        if kind == "cancelled":
            raise asyncio.CancelledError()
        if kind == "exit":
            raise SystemExit(3)
        _sleep(sleep)
    return {"key": key, "runs": runs}


if E.get("FENCE_T_RELEASE_DELAY"):
    # Widen the window in which a finished attempt's lease release waits in the worker (for the
    # next claim to carry it): a worker stopped in it must still send it.
    import celery_fence.leases.renewer

    celery_fence.leases.renewer.RELEASE_DELAY = float(E["FENCE_T_RELEASE_DELAY"])


if E.get("FENCE_T_UNRUN_DELAY"):
    # Delay the worker's record of a revoke (terminate=True included) by this many seconds, so
    # that a terminated body's own settle step reaches the store first.
    import celery_fence.adapters.worker

    _settle_unrun = celery_fence.adapters.worker.FencedRequest._settle_unrun

    def _settle_unrun_later(self: Any, why: str, terminated: bool) -> Any:
        time.sleep(float(E["FENCE_T_UNRUN_DELAY"]))  # green under gevent
        return _settle_unrun(self, why, terminated)

    celery_fence.adapters.worker.FencedRequest._settle_unrun = _settle_unrun_later  # type: ignore[method-assign]


if E.get("FENCE_T_INTERRUPT_SETTLE_DELAY"):
    # Delay a body's own settle step after an interrupt (GreenletExit from revoke(terminate=True))
    # by this many seconds, so that the worker's record of the revoke reaches the store first.
    import celery_fence.pipeline.execution
    import celery_fence.pipeline.outcomes

    _settle = celery_fence.pipeline.execution.Execution.settle

    def _settle_interrupt_later(self: Any, outcome: Any) -> Any:
        if isinstance(outcome, celery_fence.pipeline.outcomes.Interrupted):
            time.sleep(float(E["FENCE_T_INTERRUPT_SETTLE_DELAY"]))  # green under gevent
        return _settle(self, outcome)

    celery_fence.pipeline.execution.Execution.settle = _settle_interrupt_later  # type: ignore[method-assign]


# -- recovery with per-task settings, and workflows kept on a re-send ---------------------------
#: The key prefix of ``own_prefix``'s leases (under the test's prefix, so its cleanup finds them).
OWN_PREFIX = f"{PREFIX}:own"
#: The Redis database of ``own_prefix``'s leases, not the app's (``fence_redis_url``), where the
#: test asks for it with ``FENCE_T_OWN_REDIS=1`` (the Sentinel and Cluster tests use this app too).
OWN_REDIS = E.get("FENCE_T_REDIS", "redis://127.0.0.1:6379/1").rsplit("/", 1)[0] + "/7"
_own_redis = {"fence_redis_url": OWN_REDIS} if E.get("FENCE_T_OWN_REDIS") == "1" else {}


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    fence_key=lambda key, **kw: key,
    fence_key_prefix=OWN_PREFIX,
    lease_ttl=1.0,
    renew_interval=0.3,
    fence_recover_after=2.0,
    **_own_redis,
)
def own_prefix(self: Any, key: str) -> dict[str, Any]:
    """A task with its own lease Redis, prefix, TTL and recovery threshold; hangs once on its
    flag."""
    hang = _takes_hang_flag(key)
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    if hang:
        _hang(key)
    return {"key": key, "generation": self.fence.generation}


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    fence_key=lambda key, **kw: key,
    fence_database_url=E.get("FENCE_T_OWN_DB"),
)
def own_database(self: Any, key: str) -> dict[str, Any]:
    """A task whose jobs live in a database of its own (``FENCE_T_OWN_DB``) when it is set."""
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    return {"key": key, "generation": self.fence.generation}


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda previous, key: key)
def follow(self: Any, previous: Any, key: str) -> dict[str, Any]:
    """A workflow's next step: given the previous step's result, says whose result it was."""
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    after = previous.get("attempt_id") if isinstance(previous, dict) else None
    return {"key": key, "after": after, "generation": self.fence.generation}


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key: key)
def stage_effect(self: Any, key: str) -> dict[str, Any]:
    """Stages one ``traced`` outbox effect (delivered by workers run with ``FENCE_T_SPANS``)."""
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    with self.fence.transaction() as conn:  # a fenced block: its commit is a span
        conn.execute(sa.text("SELECT 1"))
    self.fence.effects.add("traced", {"key": key})
    return {"key": key, "generation": self.fence.generation}


if E.get("FENCE_T_SPANS"):  # the trace tests' workers: spans to a file, an outbox
    from celery_fence.ops.outbox import Outbox
    from tests.support import spans

    spans.export_to_file(E["FENCE_T_SPANS"])
    if E.get("FENCE_T_CELERY_OTEL") == "1":  # beside opentelemetry-instrumentation-celery
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()
    outbox = Outbox(app)

    @outbox.handler("traced")
    def traced(payload: Any, *, idempotency_key: str) -> None:
        ledger.rpush(f"{PREFIX}:delivered:{payload['key']}", idempotency_key)


# -- cluster-wide limits: concurrency groups and rate limits ----------------------------------
def _span(key: str, sleep: float) -> None:
    """Record ``<start>:<end>`` (wall clock) of this body to ``<prefix>:spans``; a body whose
    ``kill:mid_body:<key>`` flag is armed records ``<start>:<kill time>`` and is SIGKILLed."""
    start = time.time()
    end = time.monotonic() + sleep
    while time.monotonic() < end:
        time.sleep(0.01)
        if faults.take(ledger, PREFIX, "kill", "mid_body", key):
            ledger.rpush(f"{PREFIX}:spans", f"{start}:{time.time()}")
            os.kill(os.getpid(), signal.SIGKILL)
    ledger.rpush(f"{PREFIX}:spans", f"{start}:{time.time()}")


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    fence_key=lambda key, **kw: key,
    fence_group=lambda args, kwargs: "limited",
    fence_group_limit=int(E.get("FENCE_T_GROUP_LIMIT", "3")),
)
def grouped(self: Any, key: str, *, sleep: float = 0.5) -> str:
    """At most ``FENCE_T_GROUP_LIMIT`` of these run at once across all workers."""
    _span(key, sleep)
    return key


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def ungrouped(self: Any, key: str, *, sleep: float = 0.5) -> str:
    """The control arm of ``grouped``: only each worker's own concurrency limits it."""
    _span(key, sleep)
    return key


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    fence_key=lambda key: key,
    fence_rate_limit=E.get("FENCE_T_RATE", "20/s"),
)
def rated(self: Any, key: str) -> str:
    """At most ``FENCE_T_RATE`` of these start, across all workers."""
    ledger.rpush(f"{PREFIX}:starts", str(time.time()))
    return key


@app.task(shared=False, rate_limit=E.get("FENCE_T_RATE", "20/s"))
def celery_rated(key: str) -> str:
    """The control arm of ``rated``: Celery's own ``rate_limit``, which is per worker."""
    ledger.rpush(f"{PREFIX}:starts", str(time.time()))
    return key
