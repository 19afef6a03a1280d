"""The celery-fence pytest plugin (entry point ``pytest11: celery_fence``).

Installed with celery-fence, it adds command-line options and fixtures and does nothing until a
test asks for a fixture. (A fenced task that runs eagerly — ``task_always_eager``, ``.apply()``
— warns with :class:`~celery_fence.errors.FenceEagerWarning` wherever it runs: fencing is not
exercised there.)
Disable it all with ``-p no:celery_fence``.

Fixtures (each test gets its own store, Redis key prefix and queue; nothing is left behind):

- ``fence_app`` — override it to return your Celery app (or ``"package.module:app"``); or set
  ``fence_app = package.module:app`` in your pytest configuration, or pass ``--fence-app``.
- ``fence_store`` — the test's :class:`~celery_fence.store.Store`: a SQLite file in the test's
  temporary directory, or with ``--fence-database-url postgresql://...`` a schema created for the
  session (dropped after it) whose rows are deleted after each test.
- ``fence_redis`` — a private key prefix on your Redis (``--fence-redis-url``, else your app's
  ``fence_redis_url``, else 127.0.0.1:6379/0), or on a ``redis-server`` the plugin starts on a
  free port when none answers; every key under the prefix is deleted after the test.
- ``fence_env`` — your app with the test's settings applied (store, Redis, key prefix, queue,
  ``--fence-lease-ttl``), undone after the test; ``fence_env.worker(name)`` makes more workers.
- ``fenced_worker`` — a real ``celery worker`` of your app on the test's queue: ``start()``,
  ``pause()``, ``resume()``, ``kill()``, ``logs``; its process group is killed after the test.
- ``fence_group_full`` — ``fill(group, limit, hold=60)``: every slot of a concurrency group taken
  (``free()`` gives them back; done after the test), so your task meets ``group_full``.
- ``fence_rate_limited`` — ``drain(rate_limit, seconds=..., task=name | group=...)``: a rate
  limit's bucket empty for ``seconds``, so your task meets ``rate_limited``.
- ``fence_unique_holder`` — ``kill(my_task.s(...))``: the holder of a unique job (a task with
  ``fence_unique``) SIGKILLed with its worker mid-body, its row left ``running`` with the
  uniqueness key; your test asserts that the next send returns that job and that it runs again
  (see ``celery_fence.testing.unique``).
- ``fence_chaos`` — the failure windows against your own task and ``assert_converged(key)``
  (``check=`` checks your own rows too).

Under pytest-django the workers use the test databases (set up before a worker starts), and with
``CELERY_FENCE_DATABASE`` the store is that alias's test database: see
:mod:`celery_fence.testing.django_db`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

_ENV_KEY = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-fence", "celery-fence fixtures")
    group.addoption(
        "--fence-app",
        default=None,
        help="the Celery app of your fenced tasks, as for celery -A (e.g. proj.celery:app)",
    )
    group.addoption(
        "--fence-database-url",
        default=None,
        help="run fence_store on this database (PostgreSQL: a fresh schema per session) "
        "instead of a SQLite file per test",
    )
    group.addoption(
        "--fence-redis-url",
        default=None,
        help="Redis for leases (default: your app's fence_redis_url, else 127.0.0.1:6379/0, "
        "else a redis-server started on a free port)",
    )
    group.addoption(
        "--fence-broker-url",
        default=None,
        help="broker for the plugin's workers (default: your app's; the fence Redis when "
        "your app has none or uses memory://)",
    )
    group.addoption(
        "--fence-lease-ttl",
        type=float,
        default=None,
        help="fence_lease_ttl of the plugin's workers, seconds (default 1.5; renewal every ttl/5)",
    )
    group.addoption(
        "--fence-real-outbox",
        action="store_true",
        default=None,
        help="the plugin's workers call your real outbox handlers (default: a recording "
        "handler; with this, idempotency keys get the namespace 'fence-test' unless your app "
        "sets fence_idempotency_namespace)",
    )
    parser.addini("fence_app", "the Celery app of your fenced tasks (module:attr)", default="")
    parser.addini(
        "fence_real_outbox",
        "the plugin's workers call your real outbox handlers (default: a recording one)",
        type="bool",
        default=False,
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    env = item.stash.get(_ENV_KEY, None)
    if env is not None and report.failed:
        for w in env.workers:
            report.sections.append((f"celery-fence worker {w.name}", w.log()[-6000:]))
    return report


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def _fence_session(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from celery_fence.testing.environment import DEFAULT_LEASE_TTL, FenceSession

    session = FenceSession(
        tmp_path_factory.mktemp("celery-fence"),
        database_url=pytestconfig.getoption("fence_database_url"),
        redis_url=pytestconfig.getoption("fence_redis_url"),
        lease_ttl=pytestconfig.getoption("fence_lease_ttl") or DEFAULT_LEASE_TTL,
    )
    yield session
    session.close()


@pytest.fixture
def fence_app(pytestconfig: pytest.Config) -> Any:
    """Your Celery app: override this fixture, or set ``fence_app`` in the pytest config."""
    path = pytestconfig.getoption("fence_app") or pytestconfig.getini("fence_app")
    if not path:
        pytest.fail(
            "celery-fence: which Celery app do your tasks use? Override the fence_app fixture "
            "(return your app), or set fence_app = package.module:app in your pytest config, or "
            "pass --fence-app package.module:app",
            pytrace=False,
        )
    return path


@pytest.fixture
def _fence_django(request: pytest.FixtureRequest) -> Any:
    """Under pytest-django: the test databases (set up now), else None."""
    from celery_fence.testing.django_db import test_databases

    return test_databases(request)


def _app_follows_the_store(request: pytest.FixtureRequest) -> bool:
    """True when the ``fence_app`` fixture asks for ``fence_store`` (itself or through its own
    fixtures): that app is pointed at the store by its own set-up, not the other way round."""
    manager = request._fixturemanager
    seen: set[str] = set()
    todo = ["fence_app"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for fixturedef in manager.getfixturedefs(name, request.node) or ():
            if "fence_store" in fixturedef.argnames:
                return True
            todo.extend(fixturedef.argnames)
    return False


def _app_database_url(request: pytest.FixtureRequest, *, alias_only: bool) -> str | None:
    """The database your app's fence settings name (``fence_database_url``, or the Django alias
    of ``fence_database`` / ``CELERY_FENCE_DATABASE``), where its own tables live; None when it
    names none (or its ``fence_app`` fixture follows ``fence_store``)."""
    from celery_fence.testing.environment import app_database_url, resolve_app

    if _app_follows_the_store(request):
        return None
    app, _ = resolve_app(request.getfixturevalue("fence_app"))
    return app_database_url(app, alias_only=alias_only)


@pytest.fixture
def fence_store(
    request: pytest.FixtureRequest, _fence_session: Any, _fence_django: Any, tmp_path: Any
) -> Iterator[Any]:
    """The test's store: under pytest-django with ``CELERY_FENCE_DATABASE``, that alias's test
    database; else the database your app's fence settings name (``fence_database_url``, or a
    Django alias), where your own tables are; else a SQLite file per test, or with
    ``--fence-database-url`` the session's PostgreSQL schema. A shared database's fence rows are
    deleted before and after each test."""
    from celery_fence.store import Store
    from celery_fence.testing.environment import clear_rows

    own = f"sqlite:///{tmp_path / 'fence.sqlite3'}"
    url = _fence_session.database_url
    app_url = None
    if _fence_django is None or _fence_django.store_url is None:
        # under pytest-django only an alias (its test database), never a URL to the real one
        app_url = _app_database_url(request, alias_only=_fence_django is not None)
    if _fence_django is not None and _fence_django.store_url is not None:
        url = _fence_django.store_url
    elif app_url is not None:
        url = app_url
    elif url is None:
        url = own
    elif url.startswith("postgresql"):
        url = _fence_session.pg_url()
    shared = url != own  # one database for the whole session
    store = Store(url)
    store.create_schema()
    if shared:
        clear_rows(store)
    yield store
    if shared:
        clear_rows(store)
    store.dispose()


@pytest.fixture
def fence_redis(_fence_session: Any, fence_app: Any) -> Iterator[Any]:
    """The test's Redis URL and private key prefix (keys deleted after the test)."""
    from celery_fence.testing.environment import DEFAULT_REDIS_URL, FenceRedis, resolve_app

    app, _ = resolve_app(fence_app)
    wanted = _fence_session.redis_url or app.conf.get("fence_redis_url") or DEFAULT_REDIS_URL
    url, server = _fence_session.redis_for(wanted)
    found = FenceRedis(url=url, prefix=f"fence-test-{uuid.uuid4().hex[:10]}", server=server)
    yield found
    found.clear()
    found.close()


@pytest.fixture
def fence_env(
    request: pytest.FixtureRequest,
    _fence_session: Any,
    fence_app: Any,
    fence_store: Any,
    fence_redis: Any,
    _fence_django: Any,
    tmp_path: Any,
) -> Iterator[Any]:
    """Your app pointed at the test's store, Redis prefix, queue and short lease TTL (and,
    under pytest-django, its workers at the test databases)."""
    from celery_fence.testing.environment import FenceEnv

    env = FenceEnv(
        fence_app,
        django_databases=None if _fence_django is None else _fence_django.names,
        store=fence_store,
        fence_redis=fence_redis,
        workdir=tmp_path / "celery-fence-workers",
        broker_url=request.config.getoption("fence_broker_url"),
        lease_ttl=_fence_session.lease_ttl,
        real_outbox=bool(
            request.config.getoption("fence_real_outbox")
            or request.config.getini("fence_real_outbox")
        ),
    )
    env.apply()
    request.node.stash[_ENV_KEY] = env
    try:
        env.check_broker()
        yield env
    finally:
        try:
            env.close()
        finally:
            env.restore()


@pytest.fixture
def fenced_worker(fence_env: Any) -> Any:
    """A real worker of your app on the test's queue (call ``start()``); stopped after the test."""
    return fence_env.worker("worker")


@pytest.fixture
def fence_chaos(fence_env: Any) -> Any:
    """The failure windows against your own task (see ``celery_fence.testing.chaos``)."""
    from celery_fence.testing.chaos import FenceChaos

    return FenceChaos(fence_env)


@pytest.fixture
def fence_group_full(fence_env: Any) -> Iterator[Any]:
    """Occupy a concurrency group's slots (see ``celery_fence.testing.limits``)."""
    from celery_fence.testing.limits import GroupFull

    faults = GroupFull(fence_env.redis.client, fence_env.prefix)
    yield faults
    faults.free()


@pytest.fixture
def fence_rate_limited(fence_env: Any) -> Any:
    """Drain a rate limit's bucket (see ``celery_fence.testing.limits``)."""
    from celery_fence.testing.limits import RateLimited

    return RateLimited(fence_env.redis.client, fence_env.prefix)


@pytest.fixture
def fence_unique_holder(fence_env: Any) -> Any:
    """Kill the holder of a unique job mid-run (see ``celery_fence.testing.unique``)."""
    from celery_fence.testing.unique import UniqueHolder

    return UniqueHolder(fence_env)
