"""What the pytest plugin's fixtures are made of: the test's store, Redis, settings and workers.

:class:`FenceSession` holds what lives for the whole pytest session (a PostgreSQL schema, a
``redis-server`` started because none answered); :class:`FenceEnv` is one test's view: the user's
app with the test's settings applied (and undone afterwards), and the workers started for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence.config import FenceConfig
from celery_fence.process.runtime import runtime
from celery_fence.store import Store
from celery_fence.testing import processes
from celery_fence.testing.broker import delete_queues

#: What the plugin's workers run (``-A``), and the variable that carries the test's settings to it.
WORKER_APP = "celery_fence.testing.worker_app"
WORKER_ENV = "CELERY_FENCE_TESTING"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_LEASE_TTL = 1.5
_MISSING = object()
_LOCAL_BACKENDS = ("cache+memory", "memory", "disabled")


def resolve_app(value: Any) -> tuple[Celery, str]:
    """``(app, import path for celery -A)`` from an app object or a ``"module:attr"`` path."""
    from celery.app.utils import find_app

    if isinstance(value, str):
        return find_app(value), value
    if not isinstance(value, Celery):
        raise TypeError(f"fence_app must return a Celery app or 'module:attr', not {value!r}")
    found = [
        (name, attr)
        for name, module in list(sys.modules.items())
        if not name.startswith(("celery_fence.testing", "__main__"))
        and not name.rsplit(".", 1)[-1].startswith(("conftest", "test_"))
        for attr, obj in list(getattr(module, "__dict__", {}).items())
        if obj is value
    ]
    found.sort(key=lambda f: (f[0] != value.main, f[0].count("."), f[0]))  # the defining module
    if not found:
        raise LookupError(
            "the plugin could not find the module that defines your Celery app, which its workers "
            "must import: return 'package.module:app' from the fence_app fixture instead"
        )
    name, attr = found[0]
    return value, f"{name}:{attr}"


# -- the session -----------------------------------------------------------------------------------


class FenceSession:
    """Lazily made, once per pytest session: the PostgreSQL schema and a ``redis-server``."""

    def __init__(
        self, workdir: Path, *, database_url: str | None, redis_url: str | None, lease_ttl: float
    ) -> None:
        self.workdir = workdir
        self.database_url = database_url
        self.redis_url = redis_url
        self.lease_ttl = lease_ttl
        self.redis_server: processes.RedisServer | None = None
        self._pg: tuple[str, str] | None = None  # (schema, URL with its search_path)

    def pg_url(self) -> str:
        """The PostgreSQL URL with this session's fresh schema as its search_path."""
        assert self.database_url is not None
        if self._pg is None:
            schema = f"fence_test_{uuid.uuid4().hex[:10]}"
            engine = sa.create_engine(self.database_url, isolation_level="AUTOCOMMIT")
            try:
                with engine.connect() as conn:
                    conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
            finally:
                engine.dispose()
            url = sa.engine.make_url(self.database_url).update_query_dict(
                {"options": f"-csearch_path={schema}"}
            )
            rendered = url.render_as_string(hide_password=False)
            Store(rendered).create_schema()
            self._pg = (schema, rendered)
        return self._pg[1]

    def redis_for(self, url: str) -> tuple[str, processes.RedisServer | None]:
        """``url`` when a Redis answers there; else the same db on a server started here."""
        if processes.redis_answers(url):
            return url, None
        if self.redis_url is not None:
            raise RuntimeError(f"--fence-redis-url {url} does not answer")
        if self.redis_server is None:
            if processes.redis_server_binary() is None:
                raise RuntimeError(
                    f"no Redis answers at {url} and redis-server is not installed: start Redis "
                    "or pass --fence-redis-url redis://host:port/db"
                )
            self.redis_server = processes.RedisServer(self.workdir).start()
        db = int(redis.connection.parse_url(url).get("db") or 0)
        return self.redis_server.url_for(db), self.redis_server

    def close(self) -> None:
        if self._pg is not None:
            schema, url = self._pg
            for store in runtime().stores():  # this process's connections to the schema
                if store.url == url:
                    store.dispose()
            engine = sa.create_engine(self.database_url or url, isolation_level="AUTOCOMMIT")
            try:
                with engine.connect() as conn:
                    conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                engine.dispose()
            self._pg = None
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None


# -- one test --------------------------------------------------------------------------------------


@dataclass
class FenceRedis:
    """The test's Redis: ``url`` (the user's, or a server the plugin started), and ``prefix``,
    the key prefix every key of this test starts with (``fence_key_prefix`` of its app)."""

    url: str
    prefix: str
    server: processes.RedisServer | None = None
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.url)
        return self._client

    def keys(self) -> list[str]:
        """Every key of this test still in Redis."""
        return sorted(k.decode() for k in self.client.scan_iter(f"{self.prefix}:*", count=1000))

    def clear(self) -> None:
        keys = list(self.client.scan_iter(f"{self.prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            self.client.delete(*keys[i : i + 500])

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def app_database_url(app: Any, *, alias_only: bool = False) -> str | None:
    """The store database the app's own settings name (``fence_database_url``, or
    ``fence_database``'s Django alias: under pytest-django its test database), else None (it
    relies on the default). ``alias_only``: the alias only."""
    from celery_fence.config import FenceConfig
    from celery_fence.settings import DEFAULT_DATABASE_URL, django_database_url

    try:
        config = FenceConfig.from_mapping(app.conf)
    except Exception:  # invalid settings: the workers say so, with the fix
        return None
    if config.database_url != DEFAULT_DATABASE_URL and not alias_only:
        return config.database_url
    if config.database is not None:
        return django_database_url(config.database)
    return None


def clear_rows(store: Store) -> None:
    """Delete every job, transition and outbox row (a PostgreSQL schema shared by the session)."""
    store.admin.delete_all_rows()


class FenceEnv:
    """One test: the user's app pointed at the test's store, Redis prefix, queue and short TTL.

    :meth:`apply` changes the app in this process (for ``delay()``, ``AsyncResult`` and
    ``get_store``) and :meth:`restore` puts every setting back; workers get the same settings
    through :mod:`celery_fence.testing.worker_app`.
    """

    def __init__(
        self,
        app_value: Any,
        *,
        store: Store,
        fence_redis: FenceRedis,
        workdir: Path,
        broker_url: str | None,
        lease_ttl: float,
        django_databases: dict[str, str] | None = None,
        real_outbox: bool = False,
    ) -> None:
        self.app, self.app_path = resolve_app(app_value)
        #: False (the default): the workers deliver outbox effects to a recording handler, never
        #: to the app's own handlers (``--fence-real-outbox`` / ``fence_real_outbox`` opts in).
        self.real_outbox = real_outbox
        #: pytest-django's test database names by alias, for the workers' settings.DATABASES
        self.django_databases = django_databases
        self.store = store
        self.redis = fence_redis
        self.workdir = workdir
        self.prefix = fence_redis.prefix
        self.queue = f"{self.prefix}-q"
        self.ledger_base = f"{self.prefix}:testing"
        self.lease_ttl = lease_ttl
        self.workers: list[processes.Worker] = []
        self.settings = self._settings(broker_url)
        if real_outbox and not self.app.conf.get("fence_idempotency_namespace"):
            # The app's real handlers, on a provider account production may share: test keys
            # never collide with production's.
            self.settings["fence_idempotency_namespace"] = "fence-test"
        self._saved: dict[str, Any] = {}

    def _settings(self, broker_url: str | None) -> dict[str, Any]:
        conf = self.app.conf
        ttl = self.lease_ttl
        settings: dict[str, Any] = {
            "fence_database_url": self.store.url,
            "fence_redis_url": self.redis.url,
            "fence_key_prefix": self.prefix,
            "fence_lease_ttl": ttl,
            "fence_renew_interval": round(ttl / 5, 3),
            "fence_retry_backoff": 0.1,
            "fence_retry_backoff_max": round(ttl, 3),
            # an outbox delivery that fails is retried at the test's pace (hours by default)
            "fence_outbox_backoff": 0.1,
            "fence_outbox_backoff_max": max(0.1, round(ttl, 3)),
            "fence_record_transitions": True,
            "task_default_queue": self.queue,
            "task_always_eager": False,
            "worker_prefetch_multiplier": 1,
            "broker_connection_retry_on_startup": True,
        }
        user_broker = conf.broker_url
        if broker_url:
            settings["broker_url"] = broker_url
        elif not user_broker or str(user_broker).startswith("memory"):
            settings["broker_url"] = self.redis.url  # a real broker the workers can share
            settings["broker_transport_options"] = {"global_keyprefix": f"{self.prefix}:broker:"}
        backend = conf.result_backend
        if not backend or str(backend).startswith(_LOCAL_BACKENDS):
            settings["result_backend"] = self.redis.url  # callers' results, for assert_converged
            settings["result_backend_transport_options"] = {
                "global_keyprefix": f"{self.prefix}:results:"
            }
        return settings

    # -- the app in this process -----------------------------------------------------------------

    def apply(self) -> None:
        conf = self.app.conf
        for name, value in self.settings.items():
            self._saved[name] = conf.changes.get(name, _MISSING)
            conf[name] = value
        self._reset_app()

    def restore(self) -> None:
        conf = self.app.conf
        for name, value in self._saved.items():
            if value is _MISSING:
                conf.changes.pop(name, None)
            else:
                conf[name] = value
        self._saved.clear()
        self._reset_app()

    def _reset_app(self) -> None:
        """Drop what the app cached from its old settings: its connection pool, result backend
        and fence configuration (all made again on next use)."""
        with contextlib.suppress(Exception):
            self.app.close()
        with contextlib.suppress(AttributeError):
            del self.app._local.backend
        FenceConfig.forget(self.app)
        for task in list(self.app.tasks.values()):
            task.__dict__.pop("_fence_cache", None)

    def check_broker(self) -> None:
        """Fail fast, with the URL, when the broker does not answer (a worker would hang)."""
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, timeout=3)
        except Exception as exc:
            raise RuntimeError(
                f"the Celery broker {self.app.conf.broker_url} does not answer "
                f"({type(exc).__name__}); start it or pass --fence-broker-url"
            ) from None

    def _delete_queues(self, queues: list[str]) -> None:
        delete_queues(self.app, queues)

    # -- workers ---------------------------------------------------------------------------------

    def worker_spec(self) -> str:
        return json.dumps(
            {
                "app": self.app_path,
                "conf": self.settings,
                "ledger_url": self.redis.url,
                "ledger_base": self.ledger_base,
                "django_databases": self.django_databases,
                "real_outbox": self.real_outbox,
            }
        )

    def worker(
        self, name: str = "w", *, queues: list[str] | None = None, concurrency: int = 1
    ) -> processes.Worker:
        """A (not started) worker of the user's app on this test's queue (and ``queues``)."""
        pythonpath = [p for p in sys.path if p and os.path.isdir(p)]
        w = processes.Worker(
            WORKER_APP,
            env={WORKER_ENV: self.worker_spec()},
            queue=queues or [self.queue],
            name=f"{self.prefix}-{name}-{uuid.uuid4().hex[:4]}",
            log_dir=self.workdir,
            concurrency=concurrency,
            cwd=Path.cwd(),
            pythonpath=pythonpath,
        )
        self.workers.append(w)
        return w

    def outbox_deliveries(self) -> list[tuple[str, str]]:
        """The outbox deliveries the workers' recording handler took so far, as (effect name,
        idempotency key) in order; empty with ``--fence-real-outbox`` (your handlers ran)."""
        raw = self.redis.client.lrange(f"{self.ledger_base}:events", 0, -1)
        events = [json.loads(r) for r in raw]
        return [(str(e["effect"]), str(e["idem"])) for e in events if e.get("ev") == "outbox"]

    def close(self) -> None:
        """Stop every worker, delete the test's queues and Redis keys, and the results it left."""
        for w in self.workers:
            w.stop()
        queues = sorted({self.queue, *(q for w in self.workers for q in w.queues)})
        self._delete_queues(queues)
        self.redis.clear()
        for store in runtime().stores():  # get_store(app) in this process
            if store.url == self.store.url:
                store.dispose()
