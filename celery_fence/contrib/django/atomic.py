"""``self.fence.atomic(using=None)``: Django's ``transaction.atomic`` whose commit is fenced.

The block is ``transaction.atomic(using=alias)`` on Django's own connection, so every write the
ORM makes inside it — ``save()``, ``select_for_update()``, ``bulk_create``, signal handlers, raw
``connection.cursor()`` — is in its transaction. Just before that transaction commits, on the
same connection and in the same transaction, the fence checks that this attempt still owns its
key: first the lease, locally (``fence.check()``), then the store's fenced ``UPDATE fence_jobs
... WHERE key, generation, attempt, status = 'running' RETURNING`` (the statement
``fence.transaction()`` runs, :meth:`Store.commit_check_cursor`). No row: everything in the block
is rolled back and :class:`~celery_fence.StaleGeneration` is raised out of it (the attempt then
settles as stale). Hence the store must live in the alias's database (``CELERY_FENCE_DATABASE``):
any other alias is refused with a :class:`~celery_fence.ConfigurationError`.

Why that check is enough (also at other isolation levels, and on SQLite): docs/design.md, "Why
the check is enough (Read Committed)".

Nesting: ``fence.atomic()`` or ``transaction.atomic()`` inside the block is a savepoint; the
check runs once, at the end of the outermost fenced block. ``transaction.on_commit`` callbacks
registered inside run only after the fenced commit (Django discards them on a rollback).

Inside a plain ``transaction.atomic()`` of your own (or ``ATOMIC_REQUESTS``), ``fence.atomic()``
is a savepoint of your transaction and the check runs at the end of the fenced block, in it; the
fenced writes commit or roll back with your transaction. Your writes outside the fenced block are
not checked.

While the block is open, an ORM write on another alias (whose transaction the check does not
cover) is refused with a :class:`~celery_fence.ConfigurationError`, as is any Django ORM write
inside ``fence.transaction()``/``session()`` (:mod:`.guard`).

On PostgreSQL the block is bounded as ``fence.transaction()`` is, for its transaction only:
``idle_in_transaction_session_timeout`` is the lease TTL (the server ends the session of a worker
paused inside the block, which frees its row locks), ``lock_timeout`` two TTLs at most
``fence_database_timeout`` (a newer attempt waits that long at most for rows a paused holder
locked), and ``statement_timeout`` is ``fence_database_timeout`` (:meth:`Store.block_bounds`).
A session ended that way is closed by Django when its
rollback fails, and Celery's Django fix-up gives the next task a new connection.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django import db as django_db
from django.db import DEFAULT_DB_ALIAS, connections
from django.db import transaction as django_transaction

from celery_fence import signals
from celery_fence.body.transaction import idle_timeout
from celery_fence.contrib.django.database import same_database_problem
from celery_fence.contrib.django.guard import refuse_uncovered_writes
from celery_fence.errors import ConfigurationError, FenceError, LeaseLost

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence
    from celery_fence.store import Store


class _Refused(Exception):
    """The ownership check found no row: raised inside Django's atomic so it rolls back."""


def _record_loss(fence: Fence) -> None:
    """Mark and record a loss seen inside the block, now that it holds no locks."""
    with contextlib.suppress(LeaseLost):
        fence.check()


@contextlib.contextmanager
def atomic(fence: Fence, using: str | None = None) -> Iterator[None]:
    """``with self.fence.atomic():`` — see the module docstring."""
    alias = using or DEFAULT_DB_ALIAS
    store = _store_of(fence)
    if fence.blocks.current() is not None:
        raise FenceError(
            "fence.atomic() inside an open fence.transaction()/session() block: the two are "
            "separate connections, and a fenced commit covers one. Use fence.atomic() alone for "
            "Django ORM writes, or run the blocks one after another."
        )
    if alias in fence.blocks.atomic:  # a savepoint of the open fenced block; it checks at its end
        fence.check()
        with django_transaction.atomic(using=alias):
            yield
        return
    fence.blocks.raise_refused()
    connection = connections[alias]
    problem = same_database_problem(store.url, alias, connection.settings_dict)
    if problem is not None:
        raise ConfigurationError(
            f"fence.atomic(using={alias!r}): Django's {alias!r} database is not the fence store's "
            f"({problem}). The fenced commit checks ownership in the same transaction as your "
            f"writes, so both live in one database: set CELERY_FENCE_DATABASE = {alias!r} (and "
            "run manage.py migrate), or pass using= an alias on the store's database."
        )
    fence.prepare_block()
    fence.blocks.atomic.add(alias)
    gaps = _IdleGaps()
    try:
        with (
            refuse_uncovered_writes(
                lambda: fence.blocks.atomic, f"fence.atomic(using={alias!r})", _fix
            ),
            connection.execute_wrapper(gaps),
            django_transaction.atomic(using=alias),
        ):
            _bound(fence, store, connection)
            yield
            if not connection.needs_rollback:  # else Django rolls back: nothing to check
                _check(fence, store, connection)
    except _Refused:
        fence.blocks.atomic.discard(alias)
        refused = store._rejected(fence.key, fence.generation, fence.attempt_id, "fenced commit")
        fence.blocks.refused = refused
        raise refused from None
    except BaseException as exc:
        fence.blocks.atomic.discard(alias)
        _record_loss(fence)  # a loss seen inside, recorded now that the block holds no locks
        if connection.vendor == "postgresql":
            disconnected = isinstance(exc, (django_db.OperationalError, django_db.InterfaceError))
            ended = idle_timeout(fence, gaps.idle, exc, disconnected=disconnected)
            if ended is not None:
                raise ended from exc
        raise
    finally:
        fence.blocks.atomic.discard(alias)


class _IdleGaps:
    """A Django execute wrapper: how long the block's connection had been idle when its latest
    statement began (PostgreSQL ends a block idle past the lease TTL: :func:`idle_timeout`)."""

    def __init__(self) -> None:
        self.active_at = time.monotonic()
        self.idle = 0.0

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        self.idle = time.monotonic() - self.active_at
        try:
            return execute(sql, params, many, context)
        finally:
            self.active_at = time.monotonic()


def _fix(alias: str) -> str:
    return (
        f"Make that write in a fence.atomic(using={alias!r}) block of its own (its database must "
        "be the store's), or outside the fenced block if it needs no fence."
    )


def _bound(fence: Fence, store: Store, connection: Any) -> None:
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(store.block_bounds(fence.lease.ttl))  # as fence.transaction()'s


def _check(fence: Fence, store: Store, connection: Any) -> None:
    signals.block_committing.send(
        sender=None, key=fence.key, attempt_id=fence.attempt_id, generation=fence.generation
    )
    with connection.cursor() as cursor:
        owner = store.block_owner_cursor(cursor, fence)  # LeaseLost: paused past the lease
    if not owner:
        raise _Refused


def _store_of(fence: Fence) -> Store:
    if fence.store is None:
        raise FenceError(
            f"fence.atomic() for {fence.key!r} has no store: it is only available inside a "
            "fenced task's body (self.fence, with @shared_task(base=FencedTask, bind=True))"
        )
    return fence.store
