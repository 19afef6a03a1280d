"""``self.fence.session()``: an ORM ``Session`` on a fenced block
(:mod:`celery_fence.body.transaction`).

**A session writes only on the block's connection.** A ``Session`` picks a connection per
statement (``get_bind()``: ``binds=`` per mapper or table, or a ``get_bind`` of its own such as
Flask-SQLAlchemy's). The fenced session asks the session's own choice and runs the statement on
the block's connection when that choice is an engine on the store's database; any other choice
(another database, a connection of its own) is refused with :class:`ConfigurationError`, and so is
a transaction the session begins on any other connection, a two-phase session and one that picks
its connections itself (``connection_callable``). A ``scoped_session`` (Flask-SQLAlchemy's
``db.session``) is the fenced session inside the block and back to what it was after.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_fence.body.blocks import Block
from celery_fence.body.transaction import join_block, open_block, store_of
from celery_fence.errors import ConfigurationError
from celery_fence.store.urls import different_database

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, scoped_session

    from celery_fence.body.fence import Fence
    from celery_fence.store import Store


@contextlib.contextmanager
def session(
    fence: Fence, factory: Callable[..., Session], bind: sa.Engine | None = None
) -> Iterator[Session]:
    """``with self.fence.session(SessionFactory) as session:`` — an ORM ``Session`` whose every
    statement runs on a fenced connection. Every ``session.commit()`` is fenced like the
    block's commit; the block commits what is left at its end and rolls back on an exception.
    ``factory`` is a ``sessionmaker`` or a ``scoped_session`` (e.g. Flask-SQLAlchemy's
    ``db.session``, which is the fenced session inside the block). ``bind`` defaults to the
    factory's own engine (a ``sessionmaker(bind=engine)``), else the store's."""
    scoped = _scoped(factory)
    make = factory if scoped is None else scoped.session_factory
    store = store_of(fence)
    block = fence.blocks.current()
    if block is not None:  # joins the open block in a savepoint; the outer one commits
        join_block(fence, block, bind, "session")
        nested = _fenced_session(make, store, block, join_transaction_mode="create_savepoint")
        with _published(scoped, nested):
            try:
                yield nested
                nested.commit()  # releases its savepoint
            except BaseException:
                nested.rollback()
                raise
            finally:
                nested.close()
        return
    with open_block(fence, _factory_engine(make) if bind is None else bind) as block:
        s = _fenced_session(make, store, block)
        with _published(scoped, s):
            try:
                yield s
                if s.in_transaction():
                    s.commit()  # fenced: _on_commit
            except BaseException:
                with contextlib.suppress(Exception):
                    s.rollback()
                raise
            finally:
                s.close()


def _scoped(factory: Any) -> scoped_session[Any] | None:
    from sqlalchemy.orm import scoped_session  # the ORM: loaded by the app that passes a session

    return factory if isinstance(factory, scoped_session) else None


@contextlib.contextmanager
def _published(scoped: scoped_session[Any] | None, session: Session) -> Iterator[None]:
    """Inside the block, ``scoped()`` (``db.session``) is the fenced session; after it, the
    registry holds what it held before (or nothing)."""
    if scoped is None:
        yield
        return
    registry = scoped.registry
    previous = registry() if registry.has() else None
    registry.set(session)
    try:
        yield
    finally:
        if previous is None:
            registry.clear()
        else:
            registry.set(previous)


def _fenced_session(
    make: Callable[..., Session], store: Store, block: Block, **options: Any
) -> Session:
    """A session from ``make`` whose every statement runs on the block's connection, or a
    :class:`ConfigurationError` saying why it cannot be."""
    from sqlalchemy.orm import Session

    s = make(bind=block.conn, **options)
    if not isinstance(s, Session):
        raise ConfigurationError(
            f"fence.session(factory): the factory made a {type(s).__name__}, not an SQLAlchemy "
            "Session: pass a sessionmaker or a scoped_session"
        )
    problem = None
    if s.twophase:
        problem = "a two-phase session (twophase=True) commits outside the fenced commit"
    elif s.connection_callable is not None:
        problem = (
            "the session picks its connections itself (connection_callable, e.g. horizontal "
            "sharding)"
        )
    if problem is not None:
        s.close()
        raise ConfigurationError(
            f"fence.session(): {problem}, so its writes cannot be fenced. Use a plain "
            "sessionmaker (or scoped_session) on the fence store's database."
        )
    s.get_bind = _BlockRouting(s.get_bind, store, block)  # type: ignore[method-assign]
    sa.event.listen(s, "after_begin", functools.partial(_refuse_other_connections, block))
    return s


class _BlockRouting:
    """A fenced session's ``get_bind``: the session's own choice (``binds=``, or a ``get_bind``
    of its own such as Flask-SQLAlchemy's), replaced by the block's connection when it is an
    engine on the store's database. Any other choice would write outside the fenced
    transaction: refused."""

    def __init__(self, choose: Callable[..., Any], store: Store, block: Block) -> None:
        self.choose = choose
        self.store = store
        self.block = block
        self.ours: set[sa.Engine] = {block.engine}

    def __call__(self, *args: Any, **kwargs: Any) -> sa.Connection:
        chosen = self.choose(*args, **kwargs)
        if chosen is self.block.conn or chosen in self.ours:
            return self.block.conn
        if isinstance(chosen, sa.Engine):
            reason = different_database(sa.engine.make_url(self.store.url), chosen.url)
            if reason is None:
                self.ours.add(chosen)
                return self.block.conn
            where = f"an engine on {chosen.url.render_as_string()} ({reason})"
        else:
            where = f"a {type(chosen).__name__} of its own, outside the fenced transaction"
        raise ConfigurationError(
            f"fence.session(): the session sends {_described(args, kwargs)} to {where}. A fenced "
            "session runs every statement on the block's connection, on the fence store's database "
            f"{sa.engine.make_url(self.store.url).render_as_string()}: map those tables to an "
            "engine on that database, or write them outside the fenced session."
        )


def _described(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What a ``get_bind()`` call routes — a mapper, else the kind of statement (never its
    text, which may hold values)."""
    mapper = args[0] if args else kwargs.get("mapper")
    if mapper is not None:
        return f"mapper {mapper}"
    clause = kwargs.get("clause")
    return "a statement" if clause is None else f"a statement ({type(clause).__name__})"


def _refuse_other_connections(
    block: Block, session: Session, transaction: Any, connection: sa.Connection
) -> None:
    """The session began a transaction: only ever on the block's connection."""
    if connection is not block.conn:
        raise ConfigurationError(
            "fence.session(): the session began a transaction on a connection that is not the "
            f"fenced block's (engine {connection.engine.url.render_as_string()}): its writes "
            "would commit without the fence. Use a session that chooses its connection through "
            "get_bind()/binds=, on the fence store's database."
        )


def _factory_engine(factory: Callable[..., Any]) -> sa.Engine | None:
    bound = getattr(factory, "kw", {}).get("bind")  # a sessionmaker(bind=...)
    return bound if isinstance(bound, sa.Engine) else None
