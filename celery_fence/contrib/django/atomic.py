"""``self.fence.atomic(using=None)``: Django's ``transaction.atomic`` whose commit is fenced.

The block is ``transaction.atomic(using=alias)`` on Django's own connection, so every write the
ORM makes inside it — ``save()``, ``select_for_update()``, ``bulk_create``, signal handlers, raw
``connection.cursor()`` — is in its transaction. Just before that transaction commits, on the
same connection and in the same transaction, the fence checks that this attempt still owns its
key: first the lease, locally (``fence.check()``), then the store's fenced ``UPDATE fence_jobs
... WHERE key, generation, attempt, status = 'running' RETURNING`` (the statement
``fence.transaction()`` runs, ``store.blocks.commit_check_cursor``). No row: everything in the block
is rolled back and :class:`~celery_fence.StaleGeneration` is raised out of it (the attempt then
settles as stale). Hence the store must live in the alias's database (``CELERY_FENCE_DATABASE``):
any other alias is refused with a :class:`~celery_fence.ConfigurationError`.

Why that check is enough (also at other isolation levels, and on SQLite): docs/design.md, "Why
the check is enough (Read Committed)".

Nesting: ``fence.atomic()`` or ``transaction.atomic()`` inside the block is a savepoint; the
check runs once, at the end of the outermost fenced block. Nesting is per thread, as Django's
connections are: a block is nested when this thread already has a fenced block open on the alias
(and Django's connection of this thread says it is in an atomic block). Two threads of one attempt
each opening ``fence.atomic()`` have two connections, two transactions, and two fenced commits:
each is checked on its own: a stale thread's block rolls back, whatever the other did.

``DATABASES[alias]["AUTOCOMMIT"] = False`` is refused with a
:class:`~celery_fence.ConfigurationError`: Django then never commits an outermost
``atomic()``, so the block's writes would roll back when the session ends while the job is stored
``completed`` (``manage.py check``, ``celery fence check`` and worker start refuse it too).

``transaction.on_commit`` callbacks registered inside run only after the fenced commit (Django
discards them on a rollback).

Inside a plain ``transaction.atomic()`` of your own (or ``ATOMIC_REQUESTS``), ``fence.atomic()``
is a savepoint of your transaction and the check runs at the end of the fenced block, in it; the
fenced writes commit or roll back with your transaction. Your writes outside the fenced block are
not checked.

While the block is open, a write committed on any other Django connection (another alias, or
this alias on another thread), whatever its text, is rolled back and refused with a
:class:`~celery_fence.ConfigurationError`, as is any Django write inside
``fence.transaction()``/``session()``; a Django write outside every block of a fenced body is
flagged per ``fence_unfenced_writes`` (:mod:`.guard`: by what the database says).

On PostgreSQL the block is bounded as ``fence.transaction()`` is, for its transaction only:
``idle_in_transaction_session_timeout`` is the lease TTL (the server ends the session of a worker
paused inside the block, which frees its row locks), ``lock_timeout`` two TTLs at most
``fence_database_timeout`` (a newer attempt waits that long at most for rows a paused holder
locked), and ``statement_timeout`` is ``fence_database_timeout`` (``store.blocks.bounds``).
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
from celery_fence.body import watch
from celery_fence.body.transaction import idle_timeout, store_of
from celery_fence.contrib.django import guard
from celery_fence.contrib.django.database import autocommit_off, same_database_problem
from celery_fence.errors import ConfigurationError, FenceError, LeaseLost

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence
    from celery_fence.store import Store


class _Refused(Exception):
    """The ownership check found no row: raised inside Django's atomic so it rolls back."""

    #: What the commit's span says (:func:`celery_fence.announce.tracing.child`): the refusal
    #: the block raises once Django rolled back.
    error_type = "StaleGeneration"


def _record_loss(fence: Fence) -> None:
    """Mark and record a loss seen inside the block, now that it holds no locks."""
    with contextlib.suppress(LeaseLost):
        fence.check()


@contextlib.contextmanager
def atomic(fence: Fence, using: str | None = None) -> Iterator[None]:
    """``with self.fence.atomic():`` — see the module docstring."""
    alias = using or DEFAULT_DB_ALIAS
    store = store_of(fence, "fence.atomic()", "@shared_task")
    if fence.blocks.current() is not None:
        raise FenceError(
            "fence.atomic() inside an open fence.transaction()/session() block: the two are "
            "separate connections, and a fenced commit covers one. Use fence.atomic() alone for "
            "Django ORM writes, or run the blocks one after another."
        )
    connection = connections[alias]  # this thread's: Django's connections are per thread
    off = autocommit_off(alias, connection.settings_dict)
    if off is not None:
        raise ConfigurationError(off)
    if alias in fence.blocks.atomic.here():
        if connection.in_atomic_block:  # a savepoint of this thread's open fenced block
            fence.check()
            with django_transaction.atomic(using=alias):
                yield
            return
        raise FenceError(
            f"fence.atomic(using={alias!r}): the enclosing fenced block's transaction on this "
            "thread's connection has ended under it (a raw COMMIT/ROLLBACK, a set_autocommit() or "
            "a closed connection inside the block): its writes were not fenced. Commit only by "
            "leaving the fenced block."
        )
    fence.blocks.raise_refused()
    problem = same_database_problem(store.url, alias, connection.settings_dict)
    if problem is not None:
        raise ConfigurationError(
            f"fence.atomic(using={alias!r}): Django's {alias!r} database is not the fence store's "
            f"({problem}). The fenced commit checks ownership in the same transaction as your "
            f"writes, so both live in one database: set CELERY_FENCE_DATABASE = {alias!r} (and "
            "run manage.py migrate), or pass using= an alias on the store's database."
        )
    fence.prepare_block()
    guard.install()  # (the execution installs it before the body: for a fence made by hand)
    # A fence made by hand (a test) is watched for the block's duration, like a body's.
    watched = contextlib.nullcontext() if watch.is_running(fence) else watch.running(fence)
    fence.blocks.atomic.add(alias)
    gaps = _IdleGaps()
    # With tracing on, the check and Django's COMMIT are the attempt's ``fence commit`` span.
    commit_span = contextlib.ExitStack()
    try:
        with (
            commit_span,
            watched,
            connection.execute_wrapper(gaps),
            django_transaction.atomic(using=alias),
        ):
            _bound(fence, store, connection)
            yield
            if not connection.needs_rollback:  # else Django rolls back: nothing to check
                if fence.execution is not None:
                    commit_span.enter_context(fence.execution.committing(f"django:{alias}"))
                _check(fence, store, connection)
                # A block nested in a transaction.atomic() of your own: that transaction's
                # commit holds the job row the check locked, so it is fenced too.
                connection.__dict__[guard.CHECKED] = True
    except _Refused:
        fence.blocks.atomic.discard(alias)  # before the loss is recorded: no block left open
        refused = store._rejected(fence.key, fence.generation, fence.attempt_id, "fenced commit")
        refused.context["where"] = "atomic"
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


def _bound(fence: Fence, store: Store, connection: Any) -> None:
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(store.blocks.bounds(fence.lease.ttl))  # as fence.transaction()'s


def _check(fence: Fence, store: Store, connection: Any) -> None:
    signals.block_committing.send(
        sender=None, key=fence.key, attempt_id=fence.attempt_id, generation=fence.generation
    )
    with connection.cursor() as cursor:
        owner = store.blocks.owner_cursor(cursor, fence)  # LeaseLost: paused past the lease
    if not owner:
        raise _Refused
