"""``fence.atomic()`` against the real stores, without workers: Django's ``transaction.atomic``
on the store's database, whose commit is fenced on the attempt's ownership of its key.

Django is configured once for this process (``settings.configure``, no ``DJANGO_SETTINGS_MODULE``,
so Celery's Django fix-up stays out of the other tests): ``default`` is the session's PostgreSQL
database, ``lite`` the test's SQLite file, ``elsewhere`` a SQLite file that is never the store's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from celery_fence.body.fence import Fence
from celery_fence.errors import (
    BlockIdleTimeout,
    ConfigurationError,
    FenceError,
    LeaseLost,
    StaleGeneration,
)
from celery_fence.leases.lease import HeldLease
from celery_fence.store import Store

if TYPE_CHECKING:
    from django.conf import LazySettings


@pytest.fixture(scope="session")
def django_setup(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> LazySettings:
    import django
    import sqlalchemy as sa
    from django.conf import settings

    pg = sa.engine.make_url(pg_url)
    elsewhere = tmp_path_factory.mktemp("django") / "elsewhere.sqlite3"
    spare = elsewhere.with_name("spare.sqlite3")
    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=[
                "django.contrib.contenttypes",
                "celery_fence.contrib.django",
                "tests.support.django_ledger",
            ],
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": pg.database,
                    "USER": pg.username,
                    "HOST": pg.host,
                    "PORT": str(pg.port or 5432),
                },
                "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(elsewhere)},
                "elsewhere": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(elsewhere)},
                "spare": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(spare)},
            },
            USE_TZ=True,
            DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        )
        django.setup()
    return settings


@pytest.fixture
def alias(django_setup: LazySettings, store: Store, db_url: str) -> Iterator[str]:
    """The Django alias on the test's store database, with the test table."""
    from django.db import connections

    from tests.support.django_ledger.models import Entry

    name = "default" if store.dialect == "postgresql" else "lite"
    connection = connections[name]
    if name == "lite":
        connection.close()
        connection.settings_dict["NAME"] = str(Path(db_url.split("///", 1)[1]))
    with connection.schema_editor() as editor:
        if Entry._meta.db_table not in connection.introspection.table_names():
            editor.create_model(Entry)
    yield name
    connection.close()


def _attempt(store: Store, *, generation: int = 1, ttl: float = 30.0) -> Fence:
    key = f"dj:{uuid.uuid4().hex}"
    attempt_id = uuid.uuid4().hex
    registration = store.register(key, generation=generation, attempt_id=attempt_id, task_name="t")
    assert registration.outcome == "registered"
    lease = HeldLease(
        key=key,
        lease_key=f"lease:{key}",
        token=attempt_id,
        generation=generation,
        ttl=ttl,
        interval=ttl / 3,
        margin=0.1,
        claimed_at=time.monotonic(),
    )
    return Fence(
        key=key,
        attempt_id=attempt_id,
        generation=generation,
        attempts=registration.attempts,
        lease=lease,
        store=store,
    )


def _takeover(store: Store, fence: Fence) -> None:
    registration = store.register(
        fence.key, generation=fence.generation + 1, attempt_id=uuid.uuid4().hex, task_name="t"
    )
    assert registration.outcome == "registered"


def _write(alias: str, fence: Fence, n: int = 1) -> None:
    from tests.support.django_ledger.models import Entry

    Entry.objects.using(alias).bulk_create(
        [Entry(key=fence.key, writer=fence.attempt_id) for _ in range(n)]
    )


def _writers(alias: str, key: str) -> list[str]:
    from tests.support.django_ledger.models import Entry

    return list(
        Entry.objects.using(alias).filter(key=key).order_by("id").values_list("writer", flat=True)
    )


def test_the_block_commits_while_the_attempt_owns_its_key(store: Store, alias: str) -> None:
    from django.db import transaction

    fence = _attempt(store)
    ran: list[str] = []
    with fence.atomic(using=alias):
        _write(alias, fence, 2)
        transaction.on_commit(lambda: ran.append("on_commit"), using=alias)
        assert ran == []  # not before the fenced commit
    assert _writers(alias, fence.key) == [fence.attempt_id] * 2
    assert ran == ["on_commit"]
    record = store.get(fence.key)  # the check touched the job row, in the store's own format
    assert record is not None and record.updated_at > record.created_at


def test_a_newer_registration_rolls_back_everything_and_raises_stale(
    store: Store, alias: str
) -> None:
    from django.db import transaction

    fence = _attempt(store)
    ran: list[str] = []
    # Given an attempt writing inside its block, whose key a newer generation registers meanwhile,
    with pytest.raises(StaleGeneration), fence.atomic(using=alias):
        _write(alias, fence, 2)
        transaction.on_commit(lambda: ran.append("on_commit"), using=alias)
        if store.dialect == "postgresql":
            _takeover(store, fence)  # another connection: the block has not touched the job row
        else:  # SQLite: the block holds the write lock, the takeover would wait for it
            store_fence_row_moves_on(alias, fence)
    # then nothing of the block landed, its on_commit never ran, and the next block refuses too.
    assert _writers(alias, fence.key) == []
    assert ran == []
    with pytest.raises(StaleGeneration), fence.atomic(using=alias):
        pytest.fail("a refused attempt must not enter another block")


def store_fence_row_moves_on(alias: str, fence: Fence) -> None:
    """A newer generation's registration, as the store writes it, on the block's own connection
    (on SQLite another connection would wait for the block's write lock)."""
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute(
            "UPDATE fence_jobs SET generation = generation + 1, attempt_id = %s WHERE key = %s",
            [uuid.uuid4().hex, fence.key],
        )


def test_signal_handlers_writing_inside_the_block_are_fenced_with_it(
    store: Store, alias: str
) -> None:
    from django.db.models.signals import post_save

    from tests.support.django_ledger.models import Entry

    def audit(sender: Any, instance: Any, using: str, **_: Any) -> None:
        if instance.writer != "audit":  # a receiver that writes a row of its own
            Entry.objects.using(using).create(key=instance.key, writer="audit")

    post_save.connect(audit, sender=Entry, weak=False, dispatch_uid="t-audit")
    fence = _attempt(store)
    try:
        # Given a save whose post_save receiver writes too, inside the block,
        with pytest.raises(StaleGeneration), fence.atomic(using=alias):
            Entry.objects.using(alias).create(key=fence.key, writer=fence.attempt_id)
            assert _writers(alias, fence.key) == [fence.attempt_id, "audit"]
            # when a newer generation registers before the block commits,
            if store.dialect == "postgresql":
                _takeover(store, fence)
            else:
                store_fence_row_moves_on(alias, fence)
    finally:
        post_save.disconnect(sender=Entry, dispatch_uid="t-audit")
    # then neither the save nor the receiver's row landed.
    assert _writers(alias, fence.key) == []


def test_nested_blocks_are_savepoints_and_the_outermost_commits(store: Store, alias: str) -> None:
    from django.db import transaction

    fence = _attempt(store)
    with fence.atomic(using=alias):
        _write(alias, fence)
        with pytest.raises(ValueError), fence.atomic(using=alias):
            _write(alias, fence)
            raise ValueError("rolled back to the savepoint")
        with transaction.atomic(using=alias):
            _write(alias, fence)
    assert _writers(alias, fence.key) == [fence.attempt_id] * 2


def test_a_lease_lost_inside_the_block_rolls_it_back(store: Store, alias: str) -> None:
    fence = _attempt(store, ttl=0.3)
    with pytest.raises(LeaseLost), fence.atomic(using=alias):
        _write(alias, fence)
        time.sleep(0.4)  # past the lease's local deadline, no renewal
    assert _writers(alias, fence.key) == []


def test_inside_a_plain_atomic_the_check_holds_the_job_row_until_the_outer_commit(
    store: Store, alias: str
) -> None:
    from django.db import transaction

    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL row locks (SQLite: the block's write lock holds everything)")
    fence = _attempt(store)
    registered = threading.Event()
    with transaction.atomic(using=alias):
        with fence.atomic(using=alias):  # a savepoint of the user's transaction; checked here
            _write(alias, fence)

        # a newer registration now waits for the job row the check locked,
        def take_over() -> None:
            _takeover(store, fence)
            registered.set()

        taker = threading.Thread(target=take_over)
        taker.start()
        assert not registered.wait(0.5)
        _write(alias, fence)  # so the rest of the outer transaction commits before it
    taker.join(10)
    assert registered.is_set()
    assert _writers(alias, fence.key) == [fence.attempt_id] * 2


def test_inside_a_plain_atomic_a_stale_block_rolls_back_to_its_savepoint(
    store: Store, alias: str
) -> None:
    from django.db import transaction

    fence = _attempt(store)
    _takeover(store, fence)
    with (
        transaction.atomic(using=alias),
        pytest.raises(StaleGeneration),
        fence.atomic(using=alias),
    ):
        _write(alias, fence)
    assert _writers(alias, fence.key) == []


def test_postgresql_the_block_is_bounded_and_the_connection_reusable(
    store: Store, alias: str
) -> None:
    from django.db import connections

    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL session settings")
    fence = _attempt(store, ttl=2.0)
    connection = connections[alias]

    def show(name: str) -> str:
        with connection.cursor() as cursor:
            cursor.execute(f"SHOW {name}")
            return str(cursor.fetchone()[0])

    with fence.atomic(using=alias):
        assert show("idle_in_transaction_session_timeout") == "2s"
        assert show("lock_timeout") == "4s"
    assert show("idle_in_transaction_session_timeout") == "0"  # for its transaction only
    assert show("lock_timeout") == "0"


def test_postgresql_a_holder_paused_inside_is_ended_and_django_reconnects(
    store: Store, alias: str
) -> None:
    from django.db import connections

    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL ends an idle-in-transaction session")
    fence = _attempt(store, ttl=0.5)
    with pytest.raises(LeaseLost), fence.atomic(using=alias):
        _write(alias, fence)
        time.sleep(1.0)  # the server ends the session after one TTL idle in the transaction
    connection = connections[alias]
    connection.close_if_unusable_or_obsolete()  # what Celery's Django fix-up does after a task
    assert _writers(alias, fence.key) == []
    again = _attempt(store)
    with again.atomic(using=alias):
        _write(alias, again)
    assert _writers(alias, again.key) == [again.attempt_id]


def test_postgresql_a_block_idle_past_the_ttl_raises_an_error_naming_the_ttl_and_the_fix(
    store: Store, alias: str
) -> None:
    from django.db import connections

    if store.dialect != "postgresql":
        pytest.skip("PostgreSQL ends an idle-in-transaction session")
    fence = _attempt(store, ttl=1.0)
    # Given a block that writes, does slow work inside it past the TTL, then writes again,
    with pytest.raises(BlockIdleTimeout) as ended, fence.atomic(using=alias):
        _write(alias, fence)
        time.sleep(1.6)
        _write(alias, fence)
    # then the error names the limit, the TTL and the fix (psycopg 3 and psycopg2 alike),
    message = str(ended.value)
    assert "fence_lease_ttl (1s" in message and "idle between two statements" in message
    assert "before the block" in message and fence.key in message
    assert ended.value.__cause__ is not None
    connections[alias].close_if_unusable_or_obsolete()
    # and nothing of the block committed.
    assert _writers(alias, fence.key) == []


def test_another_database_is_refused(store: Store, alias: str) -> None:
    fence = _attempt(store)
    with (
        pytest.raises(ConfigurationError, match="CELERY_FENCE_DATABASE"),
        fence.atomic(using="elsewhere"),
    ):
        pytest.fail("an alias on another database must be refused before the block")


def test_a_django_connection_as_bind_points_to_atomic(store: Store, alias: str) -> None:
    from django.db import connection, connections

    fence = _attempt(store)
    for bind in (connection, connections[alias]):
        with (
            pytest.raises(ConfigurationError, match=r"fence\.atomic\(\)"),
            fence.transaction(bind=bind),
        ):
            pytest.fail("a Django connection must be refused")


def test_transaction_inside_atomic_is_refused(store: Store, alias: str) -> None:
    fence = _attempt(store)
    with fence.atomic(using=alias):
        with pytest.raises(FenceError, match="separate connections"), fence.transaction():
            pytest.fail("two connections cannot share one fenced commit")
        _write(alias, fence)
    assert _writers(alias, fence.key) == [fence.attempt_id]


def test_an_orm_write_inside_transaction_is_refused_not_left_unfenced(
    store: Store, alias: str
) -> None:
    from django.db import connections

    fence = _attempt(store)
    # An ORM write inside fence.transaction() runs on Django's connection, which the block's
    # fenced commit does not cover: refused, pointing to fence.atomic(), and nothing written.
    fix = rf"fence\.atomic\(using='{alias}'\)"
    refused = rf"INSERT on the '{alias}' database.*{fix}"
    with pytest.raises(ConfigurationError, match=refused), fence.transaction():
        _write(alias, fence)
    with (
        pytest.raises(ConfigurationError, match="DELETE"),
        fence.transaction(),
        connections[alias].cursor() as cursor,  # raw SQL on Django's connection too
    ):
        cursor.execute("DELETE FROM t_django_entries WHERE key = %s", [fence.key])
    assert _writers(alias, fence.key) == []
    # Reads pass inside the block; outside it the ORM is the app's own again.
    with fence.transaction():
        assert _writers(alias, fence.key) == []
    _write(alias, fence)
    assert _writers(alias, fence.key) == [fence.attempt_id]


def test_a_write_on_another_alias_inside_atomic_is_refused(store: Store, alias: str) -> None:
    fence = _attempt(store)
    # The fenced commit covers the block's alias only: a write on another alias is refused, and
    # the block's own writes roll back with it.
    with (
        pytest.raises(ConfigurationError, match="INSERT on the 'spare' database"),
        fence.atomic(using=alias),
    ):
        _write(alias, fence)
        _write("spare", fence)
    assert _writers(alias, fence.key) == []
    with fence.atomic(using=alias):
        _write(alias, fence)
    assert _writers(alias, fence.key) == [fence.attempt_id]


def test_django_runs_on_the_driver_this_process_has(alias: str) -> None:
    from django.db import connections

    # psycopg 3 when it is importable (Django prefers it); psycopg2 where it is hidden (the
    # psycopg2 run of this module, below).
    hidden = sys.modules.get("psycopg", False) is None
    expected = "psycopg2" if hidden else "psycopg"
    assert connections["default"].Database.__name__ == expected


def test_fence_atomic_on_django_with_psycopg2(tmp_path: Path) -> None:
    # Django picks psycopg 3 whenever it is installed; with psycopg 3 hidden it runs on psycopg2:
    # this module's PostgreSQL cases again, on that driver, in a process of their own.
    selected = (
        "postgresql and (driver_this_process or commits_while or newer_registration or "
        "holder_paused or bounded or orm_write_inside or another_alias or nested or "
        "idle_past_the_ttl)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "tests.support.hide_psycopg3",
            "--basetemp",
            str(tmp_path / "bt"),
            f"{__file__}",
            "-k",
            selected,
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed[1]) >= 8, proc.stdout[-2000:]


# -- CELERY_FENCE_DATABASE ------------------------------------------------------------------------


def test_the_store_url_is_built_from_the_alias(django_setup: LazySettings, pg_url: str) -> None:
    import sqlalchemy as sa

    from celery_fence.config import FenceConfig

    config = FenceConfig.from_mapping({"CELERY_FENCE_DATABASE": "default"})
    built, expected = sa.engine.make_url(config.database_url), sa.engine.make_url(pg_url)
    assert (built.host, built.port, built.database) == (
        expected.host,
        expected.port or 5432,
        expected.database,
    )
    Store(config.database_url).get("anything")  # it connects
    explicit = FenceConfig.from_mapping(
        {"CELERY_FENCE_DATABASE": "default", "CELERY_FENCE_DATABASE_URL": "sqlite:///x.db"}
    )
    assert explicit.database_url == "sqlite:///x.db"  # an explicit URL wins


def test_options_pass_to_the_url_and_bad_aliases_are_clear(django_setup: LazySettings) -> None:
    from celery_fence.config import FenceConfig
    from celery_fence.contrib.django.database import url_for_settings

    url = url_for_settings(
        "x",
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "db",
            "USER": "u",
            "PASSWORD": "p@ss",
            "HOST": "h",
            "PORT": "6543",
            "OPTIONS": {"sslmode": "require", "server_side_binding": True},
        },
    )
    driver, _, rest = url.partition("://")
    assert driver in ("postgresql+psycopg", "postgresql+psycopg2")  # psycopg 3 when installed
    assert rest == "u:p%40ss@h:6543/db?sslmode=require"
    with pytest.raises(ConfigurationError, match=r"not an alias in DATABASES.*'default'"):
        FenceConfig.from_mapping({"CELERY_FENCE_DATABASE": "nope"})
    with pytest.raises(ConfigurationError, match=r"ENGINE 'django\.db\.backends\.mysql'"):
        url_for_settings("x", {"ENGINE": "django.db.backends.mysql", "NAME": "db"})
    with pytest.raises(ConfigurationError, match="in-memory"):
        url_for_settings("x", {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})


def test_manage_py_check_reports_bad_fence_settings(django_setup: LazySettings) -> None:
    from django.test import override_settings

    from celery_fence.contrib.django.checks import check_settings

    with override_settings(CELERY_FENCE_DATABASE="nope"):
        errors = check_settings()
    assert [e.id for e in errors] == ["celery_fence.E001"]
    assert "nope" in errors[0].msg
    with override_settings(CELERY_FENCE_LEASE_TTL=-1, CELERY_FENCE_DATABASE="default"):
        assert [e.id for e in check_settings()] == ["celery_fence.E001"]
    with override_settings(CELERY_FENCE_DATABASE="default"):
        assert check_settings() == []
    assert [e.id for e in check_settings()] == ["celery_fence.E002"]  # no store named


# -- manage.py migrate ----------------------------------------------------------------------------


class NoFence:
    """A database router that keeps the celery_fence app out of every database."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if app_label == "celery_fence" else None


def test_migrate_makes_the_fence_tables_only_in_the_fence_alias(django_setup: LazySettings) -> None:
    import sqlalchemy as sa
    from django.core.management import call_command
    from django.db import connections
    from django.test import override_settings

    from celery_fence import migrate
    from celery_fence.contrib.django.database import url_for_alias

    def fence_tables(alias: str) -> set[str]:
        engine = sa.create_engine(url_for_alias(alias))
        try:
            return set(sa.inspect(engine).get_table_names()) & migrate.TABLES
        finally:
            engine.dispose()

    # Given CELERY_FENCE_DATABASE naming 'elsewhere', and a router keeping the app out at first,
    with override_settings(CELERY_FENCE_DATABASE="elsewhere"):
        with override_settings(DATABASE_ROUTERS=[NoFence()]):
            call_command("migrate", "celery_fence", "zero", database="elsewhere", verbosity=0)
            call_command("migrate", "celery_fence", database="elsewhere", verbosity=0)
        assert fence_tables("elsewhere") == set()  # the router said no
        call_command("migrate", "celery_fence", "zero", database="elsewhere", verbosity=0)
        # when migrate runs on every alias,
        call_command("migrate", "celery_fence", database="elsewhere", verbosity=0)
        call_command("migrate", "celery_fence", database="spare", verbosity=0)
    # then only the fence alias has the tables, at the version init-db makes.
    assert fence_tables("elsewhere") == set(migrate.TABLES)
    assert migrate.current(url_for_alias("elsewhere")) == (migrate.head(),)
    assert fence_tables("spare") == set()
    for alias in ("elsewhere", "spare"):
        connections[alias].close()
