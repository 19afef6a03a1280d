"""``fence.atomic()`` against the real stores, without workers: Django's ``transaction.atomic``
on the store's database, whose commit is fenced on the attempt's ownership of its key.

Django is configured once for this process (``settings.configure``, no ``DJANGO_SETTINGS_MODULE``,
so Celery's Django fix-up stays out of the other tests): ``default`` is the session's PostgreSQL
database, ``lite`` the test's SQLite file, ``elsewhere`` a SQLite file that is never the store's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

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
from tests.support.worker import wait_until

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
                # another Django connection on the store's PostgreSQL database
                "beside": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": pg.database,
                    "USER": pg.username,
                    "HOST": pg.host,
                    "PORT": str(pg.port or 5432),
                },
                # AUTOCOMMIT off: the store's databases (NAME set by the test on SQLite)
                "manual": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": pg.database,
                    "USER": pg.username,
                    "HOST": pg.host,
                    "PORT": str(pg.port or 5432),
                    "AUTOCOMMIT": False,
                },
                "manual_lite": {
                    "ENGINE": "django.db.backends.sqlite3",
                    "NAME": str(spare),
                    "AUTOCOMMIT": False,
                },
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


def _in_thread(target: Any) -> BaseException | None:
    """Run ``target`` on a thread of its own (Django gives it its own connections, closed at its
    end); what it raised, if anything."""
    from django.db import connections

    raised: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            raised.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return raised[0] if raised else None


def test_two_threads_in_atomic_each_commit_is_fenced(store: Store, alias: str) -> None:
    # Given an attempt with fence.atomic() open on this thread (nothing written yet, so on SQLite
    # it holds no lock),
    fence = _attempt(store)
    with pytest.raises(StaleGeneration), fence.atomic(using=alias):

        def second() -> None:
            # and a second thread of the attempt opening fence.atomic() too (its own connection:
            # an outermost block of its own, not a savepoint of the first),
            with fence.atomic(using=alias):
                _takeover(store, fence)  # when a newer generation registers meanwhile,
                _write(alias, fence)

        raised = _in_thread(second)
        # then the second thread's commit is checked and refused: its write does not land,
        assert isinstance(raised, StaleGeneration), raised
        assert _writers(alias, fence.key) == []
        _write(alias, fence)  # and the first thread's block is refused at its end too.
    assert _writers(alias, fence.key) == []


def test_two_threads_in_atomic_both_commit_while_the_attempt_owns_its_key(
    store: Store, alias: str
) -> None:
    fence = _attempt(store)
    with fence.atomic(using=alias):

        def second() -> None:
            with fence.atomic(using=alias):
                _write(alias, fence)
                with fence.atomic(using=alias):  # nested on this thread: a savepoint
                    _write(alias, fence)

        assert _in_thread(second) is None
        assert fence.blocks.atomic.here() == {alias}  # the other thread's block is its own
        _write(alias, fence)
    assert _writers(alias, fence.key) == [fence.attempt_id] * 3
    assert not fence.blocks.atomic


def test_autocommit_off_is_refused(store: Store, alias: str, db_url: str) -> None:
    from django.db import connections

    # Given DATABASES[...]["AUTOCOMMIT"] = False on the store's database (Django then never
    # commits an outermost atomic block: the writes would roll back, the job say completed),
    manual = "manual" if store.dialect == "postgresql" else "manual_lite"
    connection = connections[manual]
    if manual == "manual_lite":
        connection.close()
        connection.settings_dict["NAME"] = str(Path(db_url.split("///", 1)[1]))
    fence = _attempt(store)
    # then fence.atomic() refuses to run, naming the setting and the fix.
    try:
        with (
            pytest.raises(ConfigurationError, match=r"\['AUTOCOMMIT'\] is False.*Remove"),
            fence.atomic(using=manual),
        ):
            _write(manual, fence)
    finally:
        connection.rollback()
        connection.close()
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


# -- Django writes the block does not cover: by what the database says ---------------------------


@pytest.fixture
def beside(alias: str, store: Store) -> Iterator[str]:
    """A Django connection the fenced blocks never cover, with the test table and one row of
    its own (writer 'original'): PostgreSQL, another alias on the store's database (with a
    writing function and procedure); SQLite, another file (the store's is locked by a block)."""
    from django.db import connections

    from tests.support.django_ledger.models import Entry

    name = "beside" if store.dialect == "postgresql" else "spare"
    connection = connections[name]
    with connection.schema_editor() as editor:
        if Entry._meta.db_table not in connection.introspection.table_names():
            editor.create_model(Entry)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM t_django_entries")
        if name == "beside":
            cursor.execute(
                "CREATE OR REPLACE FUNCTION t_django_stale(k text) RETURNS int LANGUAGE plpgsql "
                "AS $$ BEGIN UPDATE t_django_entries SET writer = 'stale' WHERE key = k; "
                "RETURN 1; END $$"
            )
            cursor.execute(
                "CREATE OR REPLACE PROCEDURE t_django_stale_proc(k text) LANGUAGE plpgsql "
                "AS $$ BEGIN UPDATE t_django_entries SET writer = 'stale' WHERE key = k; END $$"
            )
    Entry.objects.using(name).create(key="beside", writer="original")
    yield name
    connection.close()


#: Writes whose text does not start with a writing verb (and plain ones), on both databases.
WRITE_FORMS = (
    "/* audit */ UPDATE t_django_entries SET writer = 'stale' WHERE key = %s",
    "WITH k AS (SELECT %s AS key)\nUPDATE t_django_entries SET writer = 'stale' "
    "WHERE key IN (SELECT key FROM k)",
    "delete from t_django_entries where key = %s",
)
PG_WRITE_FORMS = (
    "SELECT t_django_stale(%s)",
    "WITH d AS (UPDATE\nt_django_entries SET writer = 'stale' WHERE key = %s RETURNING id) "
    "SELECT count(*) FROM d",
    "CALL t_django_stale_proc(%s)",
)


def _beside_writes(name: str) -> list[tuple[str, Callable[[], Any]]]:
    """Every way a Django write on ``name`` is tried: each form in autocommit and inside a plain
    ``transaction.atomic()``, the ORM both ways, and ``cursor.callproc`` (PostgreSQL)."""
    from django.db import connections, transaction

    from tests.support.django_ledger.models import Entry

    def raw(statement: str) -> None:
        with connections[name].cursor() as cursor:
            cursor.execute(statement, ["beside"])

    def in_atomic(run: Callable[[], Any]) -> Callable[[], Any]:
        def wrapped() -> None:
            with transaction.atomic(using=name):
                run()

        return wrapped

    def callproc() -> None:
        with connections[name].cursor() as cursor:
            cursor.callproc("t_django_stale", ["beside"])

    forms = WRITE_FORMS + (PG_WRITE_FORMS if name == "beside" else ())
    tries: list[tuple[str, Callable[[], Any]]] = []
    for statement in forms:
        tries.append((f"autocommit {statement!r}", functools.partial(raw, statement)))
        tries.append((f"atomic {statement!r}", in_atomic(functools.partial(raw, statement))))

    def orm_update() -> None:
        Entry.objects.using(name).filter(key="beside").update(writer="stale")

    def orm_create() -> None:
        Entry.objects.using(name).create(key="beside", writer="stale")

    tries += [
        ("ORM update (autocommit)", orm_update),
        ("ORM create (autocommit)", orm_create),
        ("ORM update in atomic", in_atomic(orm_update)),
        ("ORM create in atomic", in_atomic(orm_create)),
    ]
    if name == "beside":
        tries.append(("callproc (autocommit)", callproc))
        tries.append(("callproc in atomic", in_atomic(callproc)))
    return tries


def _reads(name: str) -> None:
    """Reads on ``name`` pass, in autocommit and in a transaction, ``FOR UPDATE SKIP LOCKED``
    included (it locks rows: PostgreSQL assigns the transaction an id, and it is still a read)."""
    from django.db import connections, transaction

    from tests.support.django_ledger.models import Entry

    assert Entry.objects.using(name).filter(key="beside").count() == 1
    locking = "SELECT id FROM t_django_entries WHERE key = %s"
    if name == "beside":
        locking += " FOR UPDATE SKIP LOCKED"
    with connections[name].cursor() as cursor:  # autocommit
        cursor.execute(locking, ["beside"])
        assert len(cursor.fetchall()) == 1
    with transaction.atomic(using=name), connections[name].cursor() as cursor:
        cursor.execute(locking, ["beside"])
        assert len(cursor.fetchall()) == 1
        if name == "beside":
            cursor.execute("WITH d AS (" + locking + ") SELECT count(*) FROM d", ["beside"])
    with transaction.atomic(using=name):
        query = Entry.objects.using(name).select_for_update(skip_locked=True)
        assert len(query.filter(key="beside")) == 1


BESIDE = (
    r"a write on a connection that is not the fenced block's, .*"
    r"The connection: Django's '(beside|spare)' database connection"
)
NOT_THE_BLOCKS = "a connection that is not the fenced block's"


@pytest.mark.parametrize("block", ["atomic", "transaction"])
def test_a_django_write_beside_an_open_block_is_refused_whatever_its_text(
    store: Store, alias: str, beside: str, block: str
) -> None:
    from django.db import connections

    fence = _attempt(store)
    opened = fence.atomic(using=alias) if block == "atomic" else fence.transaction()
    # Given a fenced block open (fence.atomic() on the store's alias, or fence.transaction()),
    with opened:
        if block == "atomic":
            _write(alias, fence)
        # when the task writes on another Django connection, in any text form, in autocommit or
        # in a transaction of its own, through the ORM or callproc,
        for what, attempt in _beside_writes(beside):
            with pytest.raises(ConfigurationError, match=BESIDE):
                attempt()
            # (refused at its commit and rolled back: the connection is usable at once)
            assert _writers(beside, "beside") == ["original"], what
            assert not connections[beside].in_atomic_block
        # then reads there still pass,
        _reads(beside)
    # and nothing of those writes landed, while the block's own write did.
    assert _writers(beside, "beside") == ["original"]
    if block == "atomic":
        assert _writers(alias, fence.key) == [fence.attempt_id]


def test_the_old_guard_let_these_pass(store: Store, alias: str, beside: str) -> None:
    """(Control) With no block open and no body running, the same writes all land: the refusal
    above is the block's doing, not the statements failing."""
    from tests.support.django_ledger.models import Entry

    for _, attempt in _beside_writes(beside):
        Entry.objects.using(beside).filter(key="beside").delete()
        Entry.objects.using(beside).create(key="beside", writer="original")
        attempt()
        assert _writers(beside, "beside") != ["original"]


def test_bookkeeping_writes_beside_a_block_pass(store: Store, alias: str, beside: str) -> None:
    from celery_fence.body import watch
    from tests.support.django_ledger.models import Entry

    fence = _attempt(store)
    # A result backend's row (django-celery-results writes it through the ORM, inside Celery's
    # bookkeeping: here a plain model stands for its TaskResult) lands beside an open block.
    with fence.atomic(using=alias):
        with watch.bookkeeping():
            Entry.objects.using(beside).create(key="result", writer="celery")
        _write(alias, fence)
    assert _writers(beside, "result") == ["celery"]
    assert _writers(alias, fence.key) == [fence.attempt_id]


def test_a_django_write_inside_transaction_on_the_store_alias_is_refused(
    store: Store, alias: str
) -> None:
    fence = _attempt(store)
    # Django's connection to the store's own database is not fence.transaction()'s connection
    # (SQLite: the block holds the file's write lock, the write waits for Django's timeout).
    with fence.transaction():
        with pytest.raises(ConfigurationError, match=f"Django's '{alias}' database connection"):
            _write(alias, fence)
        assert _writers(alias, fence.key) == []
    _write(alias, fence)  # outside the block (and no body running) it is the app's own again
    assert _writers(alias, fence.key) == [fence.attempt_id]


def test_sqlalchemy_writes_inside_atomic_are_refused(store: Store, alias: str, db_url: str) -> None:
    import sqlalchemy as sa

    fence = _attempt(store)
    engine = sa.create_engine(db_url)
    try:
        # Given a stale attempt's fence.atomic() block (a newer generation registers inside it),
        with pytest.raises(StaleGeneration), fence.atomic(using=alias):
            # a write through the app's SQLAlchemy engine (not the block's connection) is
            # refused at its commit,
            with (
                pytest.raises(ConfigurationError, match=NOT_THE_BLOCKS),
                engine.begin() as conn,
            ):
                conn.execute(
                    sa.text("INSERT INTO t_django_entries (key, writer) VALUES (:k, 'sqla')"),
                    {"k": fence.key},
                )
            _takeover_in_block(store, alias, fence)
            _write(alias, fence)
    finally:
        engine.dispose()
    # and nothing of the attempt lands.
    assert _writers(alias, fence.key) == []


def test_the_async_orm_run_inside_atomic_is_refused(store: Store, alias: str) -> None:
    import asyncio

    from tests.support.django_ledger.models import Entry

    fence = _attempt(store)
    # Django's async ORM runs the query on a thread of asgiref's (its own connection, outside
    # the block's transaction): the write is refused at its commit, and nothing lands.
    with pytest.raises(StaleGeneration), fence.atomic(using=alias):
        with pytest.raises(ConfigurationError, match=NOT_THE_BLOCKS):
            asyncio.run(Entry.objects.using(alias).acreate(key=fence.key, writer="async"))
        _takeover_in_block(store, alias, fence)
    assert _writers(alias, fence.key) == []


def _takeover_in_block(store: Store, alias: str, fence: Fence) -> None:
    if store.dialect == "postgresql":
        _takeover(store, fence)
    else:
        store_fence_row_moves_on(alias, fence)


# -- Django writes outside every block of a fenced body: flagged ---------------------------------


def _body_fence(store: Store, mode: str) -> Fence:
    """A registered attempt with its execution (task name of its own), as FencedTask builds it."""
    from celery_fence.announce.transitions import Announcer
    from celery_fence.config import FenceConfig
    from celery_fence.pipeline.claim import Claim
    from celery_fence.pipeline.execution import Execution

    fence = _attempt(store)
    execution = Execution(
        fence.key,
        task_name=f"tasks.dj_{uuid.uuid4().hex[:8]}",
        config=FenceConfig(database_url=store.url, unfenced_writes=mode),
        store=store,
        leases=cast(Any, None),
        renewer=cast(Any, None),
        policy=cast(Any, None),
        announcer=Announcer("dj-test"),
        attempt_id=fence.attempt_id,
    )
    execution.claim = Claim(fence.attempt_id, generation=fence.generation, registered=True)
    fence.execution = execution
    return fence


@pytest.fixture
def running(store: Store, alias: str) -> Callable[[str], contextlib.AbstractContextManager[Fence]]:
    from celery_fence.body import watch
    from celery_fence.body.transaction import watch_django

    @contextlib.contextmanager
    def body(mode: str) -> Iterator[Fence]:
        fence = _body_fence(store, mode)
        watch_django()  # what the execution does before the body
        with watch.running(fence):
            yield fence

    return body


def _outside_writes(alias: str, fence: Fence) -> list[Callable[[], Any]]:
    from django.db import transaction

    from tests.support.django_ledger.models import Entry

    def plain_atomic() -> None:
        with transaction.atomic(using=alias):
            Entry.objects.using(alias).create(key=fence.key, writer="atomic")

    def autocommit_create() -> None:
        Entry.objects.using(alias).create(key=fence.key, writer="autocommit")

    return [plain_atomic, autocommit_create]


def test_a_django_write_outside_any_block_warns_once_records_and_signals(
    store: Store, alias: str, running: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from celery_fence import signals
    from tests.support.django_ledger.models import Entry

    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.unfenced_write.connect(receiver, weak=False)
    caplog.set_level(logging.WARNING, logger="celery_fence")
    try:
        with running("warn") as fence:
            # Given a fenced body that writes with plain transaction.atomic() and in autocommit,
            for write in _outside_writes(alias, fence):
                write()
            # (reads say nothing)
            assert Entry.objects.using(alias).filter(key=fence.key).count() == 2
    finally:
        signals.unfenced_write.disconnect(receiver)
    # then the writes land (warn), one WARNING names the task, the connection and the table,
    assert sorted(_writers(alias, fence.key)) == ["atomic", "autocommit"]
    warnings = [r for r in caplog.records if "unfenced write" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert fence.execution is not None and fence.execution.task_name in message
    assert "Django's" in message and "t_django_entries" in message
    # and the attempt's history and the signal say so.
    assert [s.get("where") for s in seen] == [f"Django's '{alias}' database connection"]

    def recorded() -> bool:
        return any(t.action == "unfenced_write" for t in store.transitions.history(fence.key))

    wait_until(recorded, timeout=10)


def test_a_django_write_outside_any_block_under_error_is_rolled_back(
    store: Store, alias: str, running: Any
) -> None:
    with running("error") as fence:
        for write in _outside_writes(alias, fence):
            with pytest.raises(ConfigurationError, match="fence_unfenced_writes='error'"):
                write()
    assert _writers(alias, fence.key) == []


def test_a_django_write_outside_any_block_under_allow_lands_quietly(
    store: Store, alias: str, running: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_fence")
    with running("allow") as fence:
        for write in _outside_writes(alias, fence):
            write()
    assert sorted(_writers(alias, fence.key)) == ["atomic", "autocommit"]
    assert not [r for r in caplog.records if "unfenced write" in r.getMessage()]


def test_a_fenced_block_nested_in_a_plain_atomic_is_not_flagged(
    store: Store, alias: str, running: Any
) -> None:
    from django.db import transaction

    # fence.atomic() inside your own transaction.atomic(): the check holds the job row until
    # that transaction commits, so its commit is fenced and not flagged (not refused either).
    with running("error") as fence, transaction.atomic(using=alias):
        with fence.atomic(using=alias):
            _write(alias, fence)
        _write(alias, fence)
    assert _writers(alias, fence.key) == [fence.attempt_id] * 2


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
        "holder_paused or bounded or beside_an_open_block or inside_transaction_on_the_store "
        "or nested or two_threads or autocommit_off or outside_any_block or async_orm "
        "or direct_call or idle_past_the_ttl)"
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
    assert passed and int(passed[1]) >= 15, proc.stdout[-2000:]


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


def test_manage_py_check_refuses_autocommit_off(django_setup: LazySettings, pg_url: str) -> None:
    from django.test import override_settings

    from celery_fence.contrib.django.checks import check_settings

    # The fence's alias with AUTOCOMMIT off: an Error (manage.py check fails), naming the fix;
    with override_settings(CELERY_FENCE_DATABASE="manual"):
        errors = check_settings()
    assert [(e.id, e.level) for e in errors] == [("celery_fence.E003", 40)]
    assert "DATABASES['manual']['AUTOCOMMIT'] is False" in errors[0].msg
    # the store set by URL on a database an AUTOCOMMIT-off alias is on: the same Error;
    with override_settings(CELERY_FENCE_DATABASE_URL=pg_url):
        assert [e.id for e in check_settings()] == ["celery_fence.E003"]
    # and the settings a worker reads refuse it.
    from celery_fence.config import FenceConfig

    with pytest.raises(ConfigurationError, match=r"CELERY_FENCE_DATABASE='manual'.*AUTOCOMMIT"):
        FenceConfig.from_mapping({"CELERY_FENCE_DATABASE": "manual"})


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


# -- a direct call inside the caller's atomic block (ATOMIC_REQUESTS, pytest-django) --------------


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql", "psycopg3"], indirect=True)
def test_a_direct_call_inside_the_callers_atomic_block_is_refused_at_once(
    alias: str, store: Store, db_url: str, prefix: str, redis_client: Any
) -> None:
    import warnings

    from celery import Celery
    from django.db import transaction

    from celery_fence import FencedTask
    from celery_fence.errors import FenceEagerWarning
    from celery_fence.leases.lease import LeaseStore
    from tests.support.django_ledger.models import Entry
    from tests.support.env import REDIS_URL

    app = Celery(f"direct-{prefix}", broker="memory://", set_as_current=False)
    app.conf.update(
        fence_redis_url=REDIS_URL,
        fence_database_url=db_url,
        fence_key_prefix=prefix,
        fence_lease_ttl=5.0,
        fence_renew_interval=1.0,
    )

    @app.task(base=FencedTask, bind=True, fence_key=lambda key: key, shared=False)
    def bill(self: Any, key: str) -> int:
        with self.fence.atomic(using=alias):  # the fenced commit checks the job row
            Entry.objects.using(alias).create(key=key, writer=self.fence.attempt_id)
        return self.fence.generation

    key = f"direct-dj:{uuid.uuid4().hex[:8]}"
    leases = LeaseStore(redis_client, prefix=prefix)
    # Given the caller's own transaction.atomic() on the store's database (ATOMIC_REQUESTS, an
    # atomic management command, pytest-django's test transaction) ...
    started = time.monotonic()
    with transaction.atomic(using=alias):
        # When the fenced task is called directly, or run eagerly, inside it
        with pytest.raises(FenceError, match="inside an open transaction") as refused:
            bill(key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FenceEagerWarning)
            eager = bill.apply(args=(key,))
        assert isinstance(eager.result, FenceError)
    # Then both are refused at once (not after a lock timeout), saying why and what to do,
    # and nothing was claimed or written: no job row (nothing for recovery to run later), no
    # lease, no write of the body
    assert time.monotonic() - started < 3.0
    assert f"alias {alias!r}" in str(refused.value)
    assert "transaction.on_commit" in str(refused.value)
    assert store.get(key) is None
    assert leases.remaining(key)[0] is None
    assert not Entry.objects.using(alias).filter(key=key).exists()
    # And called outside any transaction, it runs, fenced, once
    assert bill(key) == 1
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 1)
    assert Entry.objects.using(alias).filter(key=key).count() == 1


# -- AUTOCOMMIT off: celery fence check and worker start ------------------------------------------


MANUAL_APP = "tests.support.django_manual_app"


def _celery_django(
    tmp_path: Path, autocommit: bool, *args: str, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.support.django_manual_app ...``: a Django project whose fence store is
    DATABASES['default'] (a SQLite file), AUTOCOMMIT on or off."""
    import os

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "DJANGO_SETTINGS_MODULE": "tests.support.django_manual_app",
        "FENCE_T_DJANGO_DB": str(tmp_path / "manual.sqlite3"),
        "FENCE_T_DJANGO_AUTOCOMMIT": "1" if autocommit else "0",
    }
    return subprocess.run(
        [str(Path(sys.executable).with_name("celery")), "-A", MANUAL_APP, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_celery_fence_check_refuses_autocommit_off(tmp_path: Path) -> None:
    # With AUTOCOMMIT on, the settings check passes (the schema is missing: init-db it first);
    assert _celery_django(tmp_path, True, "fence", "init-db").returncode == 0
    good = _celery_django(tmp_path, True, "fence", "check")
    assert good.returncode == 0, good.stdout + good.stderr
    # with AUTOCOMMIT off, `celery fence check` fails on one line naming the setting and the fix.
    bad = _celery_django(tmp_path, False, "fence", "check")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode != 0 and len(lines) == 1, bad.stdout + bad.stderr
    assert "['AUTOCOMMIT'] is False" in lines[0] and "Remove 'AUTOCOMMIT': False" in lines[0]
    assert "Traceback" not in bad.stderr


def test_worker_start_refuses_autocommit_off(tmp_path: Path) -> None:
    # A worker of a project with AUTOCOMMIT off does not start: it exits at once, saying why.
    proc = _celery_django(
        tmp_path,
        False,
        "worker",
        "--pool=solo",
        "--concurrency=1",
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "--loglevel=WARNING",
        timeout=120.0,
    )
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "invalid settings, the worker does not start" in out, out[-3000:]
    assert "['AUTOCOMMIT'] is False" in out


def _traced_attempt(store: Store) -> tuple[Fence, Any]:
    """A fence whose execution is traced (:mod:`celery_fence.announce.tracing`), with the
    execution's key, generation and attempt id."""
    from celery_fence.announce import tracing
    from celery_fence.announce.transitions import Announcer
    from celery_fence.config import FenceConfig
    from celery_fence.leases.renewer import Renewer
    from celery_fence.pipeline.claim import Claim
    from celery_fence.pipeline.execution import Execution
    from celery_fence.pipeline.retry import RetryPolicy
    from tests.support.memory import MemoryLeaseStore

    fence = _attempt(store)
    trace_ = tracing.attempt_trace()
    assert trace_ is not None
    config = FenceConfig()
    leases = MemoryLeaseStore()
    execution = Execution(
        fence.key,
        task_name="t",
        config=config,
        store=store,
        leases=leases,
        renewer=Renewer(leases),
        policy=RetryPolicy(config),
        announcer=Announcer("t", trace=trace_),
        trace=trace_,
        attempt_id=fence.attempt_id,
    )
    execution.claim = Claim(fence.attempt_id, generation=fence.generation, registered=True)
    fence.execution = execution
    return fence, trace_


def test_a_traced_block_commit_is_a_span_of_the_attempt(store: Store, alias: str) -> None:
    from tests.support.spans import process_exporter

    exporter = process_exporter()
    exporter.clear()
    # Given a traced attempt whose first block commits and whose second is refused (stale)
    fence, trace_ = _traced_attempt(store)
    with trace_.running("t", fence.key, fence.attempt_id, None):
        with fence.atomic(using=alias):
            _write(alias, fence)
        with pytest.raises(StaleGeneration), fence.atomic(using=alias):
            _write(alias, fence)
            store_fence_row_moves_on(alias, fence)
    fence.execution.renewer.stop()  # type: ignore[union-attr]
    # Then each commit is a "fence commit" span under the attempt's, the refused one an error
    spans = exporter.get_finished_spans()
    (attempt,) = [s for s in spans if s.name == "fence attempt t"]
    commits = [s for s in spans if s.name == "fence commit"]
    assert [c.parent.span_id for c in commits if c.parent] == [attempt.context.span_id] * 2
    assert [dict(c.attributes or {}).get("fence.block") for c in commits] == [f"django:{alias}"] * 2
    assert [c.status.status_code.name for c in commits] == ["UNSET", "ERROR"]
    assert (commits[1].attributes or {})["error.type"] == "StaleGeneration"
