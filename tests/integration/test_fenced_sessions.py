"""``fence.session()`` against the real stores, without workers: every statement of the session
runs on the fenced connection, whatever engine the session's own routing picks
(``sessionmaker(binds=...)``, Flask-SQLAlchemy's ``get_bind``); a session that cannot be fenced is
a ``ConfigurationError``; a ``scoped_session`` is the fenced session inside the block and is left
as it was after it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from celery_fence.errors import ConfigurationError, StaleGeneration
from celery_fence.store import Store
from tests.integration.test_transaction import (
    Row,
    _attempt,
    _takeover,
    _writers,
    metadata,
    reports,
    rows,
)

#: A table whose metadata Flask-SQLAlchemy routes to the bind key "other".
other_metadata = sa.MetaData(info={"bind_key": "other"})
other_rows = sa.Table(
    "t_tx_other_rows",
    other_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("writer", sa.String(64), nullable=False),
)


@pytest.fixture
def tables(store: Store) -> Store:
    metadata.create_all(store.engine)
    return store


@pytest.fixture
def app_engine(tables: Store) -> Iterator[sa.Engine]:
    """The app's own engine on the store's database."""
    engine = sa.create_engine(tables.url)
    yield engine
    engine.dispose()


@pytest.fixture
def other_url(tables: Store, tmp_path: Path) -> str:
    """A database that is not the store's (never connected to by these tests)."""
    if tables.dialect == "sqlite":
        return f"sqlite:///{tmp_path / 'other.sqlite3'}"
    return sa.make_url(tables.url).set(database="postgres").render_as_string(hide_password=False)


@pytest.mark.parametrize("target", ["mapper", "table"])
def test_a_session_routed_by_binds_writes_on_the_block_and_a_stale_commit_lands_nothing(
    tables: Store, app_engine: sa.Engine, target: str
) -> None:
    # Given a sessionmaker that sends the model's table to the app's own engine,
    factory = sessionmaker(binds={Row if target == "mapper" else rows: app_engine})
    fence = _attempt(tables)
    # when the attempt writes through the fence while it owns its key, the rows land,
    with fence.session(factory) as session:
        session.add(Row(fence.key, "owner"))
    assert _writers(tables, fence.key) == ["owner"]
    # and once a newer generation registered, its commit is refused and nothing of it lands.
    _takeover(tables, fence)
    with pytest.raises(StaleGeneration), fence.session(factory) as session:
        session.add(Row(fence.key, "stale"))
        session.execute(rows.insert().values(key=fence.key, writer="stale-core"))
    assert _writers(tables, fence.key) == ["owner"]


def test_flask_sqlalchemy_db_session_is_the_fenced_session_inside_the_block(
    tables: Store,
) -> None:
    flask_app = Flask(__name__)
    flask_app.config["SQLALCHEMY_DATABASE_URI"] = tables.url
    db = SQLAlchemy()
    db.init_app(flask_app)
    fence = _attempt(tables)
    with flask_app.app_context():
        before = db.session()  # the session the app context already had
        # Given Flask-SQLAlchemy's session, whose get_bind sends everything to its own engine,
        with fence.session(db.session) as session:
            assert db.session() is session  # inside the block, db.session is the fenced session
            db.session.add(Row(fence.key, "flask"))
        assert db.session() is before  # and after it, what it was
        # when a newer generation registered, then a write through db.session is refused.
        _takeover(tables, fence)
        with pytest.raises(StaleGeneration), fence.session(db.session):
            db.session.add(Row(fence.key, "stale"))
            db.session.execute(rows.insert().values(key=fence.key, writer="stale-core"))
        assert db.session() is before
        for engine in db.engines.values():
            engine.dispose()
    assert _writers(tables, fence.key) == ["flask"]


def test_a_session_that_routes_to_another_database_is_refused_and_nothing_lands(
    tables: Store, other_url: str
) -> None:
    other = sa.create_engine(other_url)
    fence = _attempt(tables)
    # sessionmaker(binds=...) to another database: refused at its first statement there
    with (
        pytest.raises(ConfigurationError, match=r"mapper .*Row.* fence store's database"),
        fence.session(sessionmaker(binds={Row: other})) as session,
    ):
        session.execute(reports.insert().values(key=fence.key, writer="before"))  # store's db
        session.add(Row(fence.key, "elsewhere"))
        session.flush()
    # Flask-SQLAlchemy with a bind key on another database: the same
    flask_app = Flask(__name__)
    flask_app.config["SQLALCHEMY_DATABASE_URI"] = tables.url
    flask_app.config["SQLALCHEMY_BINDS"] = {"other": other_url}
    db = SQLAlchemy()
    db.init_app(flask_app)
    with flask_app.app_context():
        with pytest.raises(ConfigurationError) as refused, fence.session(db.session):
            db.session.execute(reports.insert().values(key=fence.key, writer="before"))
            db.session.execute(other_rows.insert().values(writer="elsewhere"))
        for engine in db.engines.values():
            engine.dispose()
    message = str(refused.value)
    assert "fence store's database" in message and "a statement (Insert)" in message
    # nothing of either block landed, and the attempt still owns its key
    with tables.engine.connect() as conn:
        assert conn.execute(sa.select(reports).where(reports.c.key == fence.key)).all() == []
    record = tables.get(fence.key)
    assert record is not None and (record.status, record.attempt_id) == (
        "running",
        fence.attempt_id,
    )
    other.dispose()


def test_a_session_that_cannot_be_fenced_is_refused_on_entry_or_first_use(
    tables: Store, app_engine: sa.Engine
) -> None:
    fence = _attempt(tables)

    class OwnConnection(Session):
        """Begins its transaction on a connection of its own choosing, not via get_bind()."""

        def connection(self, *args: Any, **kwargs: Any) -> sa.Connection:
            return self._connection_for_bind(app_engine, None)

    with (
        pytest.raises(ConfigurationError, match="not the fenced block's"),
        fence.session(sessionmaker(class_=OwnConnection)) as session,
    ):
        session.connection().execute(rows.insert().values(key=fence.key, writer="own"))
    with (
        pytest.raises(ConfigurationError, match="two-phase"),
        fence.session(sessionmaker(twophase=True)),
    ):
        pytest.fail("entered a block with a two-phase session")
    with (
        pytest.raises(ConfigurationError, match="not an SQLAlchemy Session"),
        fence.session(lambda **kw: object()),  # type: ignore[arg-type]
    ):
        pytest.fail("entered a block without a session")
    assert _writers(tables, fence.key) == []


def test_a_scoped_session_twice_in_a_row_on_one_thread(tables: Store) -> None:
    scoped = scoped_session(sessionmaker())
    fence = _attempt(tables)
    # Given a scoped session, used for two fenced blocks one after the other on one thread,
    for n in range(2):
        with fence.session(scoped) as session:
            assert scoped() is session
            scoped.add(Row(fence.key, f"scoped-{n}"))
        # then after each, the thread's registry is as it was (empty),
        assert not scoped.registry.has()
    assert _writers(tables, fence.key) == ["scoped-0", "scoped-1"]
    # and a session the thread already had is its session again after the block.
    mine = scoped()
    with fence.session(scoped) as session:
        assert session is not mine and scoped() is session
    assert scoped() is mine
    scoped.remove()


def test_a_write_beside_the_block_is_refused_not_left_unfenced(
    tables: Store, app_engine: sa.Engine
) -> None:
    fence = _attempt(tables)
    # Inside fence.transaction(), a write on another connection — the app's own engine, a
    # second connection of the store's engine — would commit unchecked: refused (the database
    # says the transaction wrote; autocommit statements, like the store engine's, one by one),
    # naming the fix.
    for engine in (app_engine, tables.engine):
        with (
            pytest.raises(
                ConfigurationError, match=r"not the fenced block's.*self\.fence\.session"
            ),
            fence.transaction(),
            engine.begin() as beside,
        ):
            beside.execute(rows.insert().values(key=fence.key, writer="beside"))
    # Flask-SQLAlchemy's db.session used directly inside transaction() (not through session()).
    flask_app = Flask(__name__)
    flask_app.config["SQLALCHEMY_DATABASE_URI"] = tables.url
    db = SQLAlchemy()
    db.init_app(flask_app)
    with flask_app.app_context():
        with pytest.raises(ConfigurationError, match="not the fenced block's"), fence.transaction():
            db.session.add(Row(fence.key, "flask-beside"))
            db.session.commit()
        db.session.rollback()
        for engine in db.engines.values():
            engine.dispose()
    assert _writers(tables, fence.key) == []
    # Reads beside the block pass; the block's own connection writes; outside, all is as before.
    with fence.transaction() as conn, app_engine.connect() as beside:
        assert beside.execute(sa.select(rows.c.writer).where(rows.c.key == fence.key)).all() == []
        conn.execute(rows.insert().values(key=fence.key, writer="block"))
    with app_engine.begin() as after:
        after.execute(rows.insert().values(key=fence.key, writer="after"))
    assert _writers(tables, fence.key) == ["block", "after"]
