"""The store's SQLAlchemy Core statements on its own tables, built per call: the reads, the
operator's and the recovery's statements, the steps and the beat ticks. The store's SQL is in
four places, one kind each: the fenced writes written out and named in :file:`queries.sql`
(loaded by :mod:`.queries`); these; the outbox's (:mod:`.outbox_sql`); the statements that set
up a session and its transactions (:mod:`.session_sql`). The store's modules run them (and
:mod:`celery_fence.body.transaction` the block statements, on the user's connection); nothing
else builds SQL on these tables.

Statuses come from :class:`~celery_fence.schema.Status`, action names from
:class:`~celery_fence.actions.Action`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from celery_fence.actions import INTERRUPTED_BY, Action
from celery_fence.schema import (
    COMPLETED,
    Status,
    beat_ticks,
    jobs,
    outbox,
    steps,
    transitions,
)
from celery_fence.store.session_sql import PG_BLOCK_MARKER

JOBS, TRANSITIONS, OUTBOX, STEPS = jobs.name, transitions.name, outbox.name, steps.name


# -- steps and checkpoints (fence.step(), fence.checkpoint()) -------------------------------------


def step_boundary(key: str, name: str) -> sa.Select[Any]:
    """At a step's start: the job row's owner (generation, attempt, status) and the step's stored
    row, if any (its value, generation), in one read."""
    found = steps.c.value.label("step_value"), steps.c.generation.label("step_generation")
    on = (steps.c.key == jobs.c.key) & (steps.c.name == name)
    return (
        sa.select(jobs.c.generation, jobs.c.attempt_id, jobs.c.status, *found)
        .select_from(jobs.outerjoin(steps, on))
        .where(jobs.c.key == key)
    )


def step_value(key: str, name: str) -> sa.Select[Any]:
    return sa.select(steps.c.value).where((steps.c.key == key) & (steps.c.name == name))


def steps_of(key: str) -> sa.Select[Any]:
    """A key's steps and checkpoint, oldest first."""
    return sa.select(steps).where(steps.c.key == key).order_by(steps.c.created_at, steps.c.name)


def clear_completed_steps(key: str) -> Any:
    """A completed job's steps and checkpoint, deleted while it is still completed (before an
    operator's re-run from scratch: the re-run's own steps are never touched)."""
    still_completed = (
        sa.select(jobs.c.key).where((jobs.c.key == key) & (jobs.c.status == COMPLETED)).exists()
    )
    return steps.delete().where((steps.c.key == key) & still_completed)


# -- reads and operator statements (SQLAlchemy Core) ----------------------------------------------


def insert_pending(
    dialect: str,
    *,
    key: str,
    task_name: str,
    request: Any,
    now: dt.datetime,
    due: dt.datetime | None = None,
    unique_key: str | None = None,
) -> Any:
    """A job enqueued with the caller's data: a ``pending`` row never claimed (generation 0,
    attempt ``-``; ``retry_at`` its countdown or eta, which recovery waits for), unless the key
    already has a job — or, with ``unique_key``, an unfinished job holds that uniqueness key
    (``ux_fence_jobs_unique_unfinished``) — then nothing; RETURNING says which."""
    insert = pg_dialect.insert(jobs) if dialect == "postgresql" else sqlite_dialect.insert(jobs)
    statement = insert.values(
        key=key,
        task_name=task_name,
        status=Status.PENDING.value,
        generation=0,
        attempt_id=NEVER_CLAIMED,
        attempts=0,
        request=request,
        retry_at=due,
        created_at=now,
        updated_at=now,
        unique_key=unique_key,
    )
    if unique_key is None:
        return statement.on_conflict_do_nothing(index_elements=[jobs.c.key]).returning(jobs.c.key)
    # no conflict target: the key's row or the uniqueness key's unfinished holder
    return statement.on_conflict_do_nothing().returning(jobs.c.key)


def unique_holder(unique_key: str) -> sa.Select[Any]:
    """The unfinished job holding ``unique_key`` (at most one: the partial unique index)."""
    return sa.select(jobs).where(
        jobs.c.unique_key == unique_key, jobs.c.status.in_(_UNFINISHED_STATUSES)
    )


def release_unique(key: str, unique_key: str, status: str) -> Any:
    """Take ``unique_key`` off job ``key`` while it is still in ``status`` (outside the unique
    states a task asked for, or past its ``unique_period``); the job itself runs on."""
    return (
        sa.update(jobs)
        .where(jobs.c.key == key, jobs.c.unique_key == unique_key, jobs.c.status == status)
        .values(unique_key=None)
    )


def replace_pending(key: str, unique_key: str, now: dt.datetime) -> Any:
    """End the never-claimed ``pending`` job ``key`` as ``dead`` (reason ``replaced``) for a newer
    job of its uniqueness key; only while nobody has claimed it (generation 0): its message,
    when a worker gets it, finds the job dead and is acked."""
    return (
        sa.update(jobs)
        .where(
            jobs.c.key == key,
            jobs.c.unique_key == unique_key,
            jobs.c.status == Status.PENDING.value,
            jobs.c.generation == 0,
        )
        .values(
            status=Status.DEAD.value,
            unique_key=None,
            finished_at=now,
            updated_at=now,
            error_type=REPLACED,
            error_message="replaced by a newer job of its uniqueness key",
        )
    )


def replaced_transition(key: str, now: dt.datetime) -> Any:
    return sa.insert(transitions).values(
        key=key,
        generation=0,
        attempt_id=NEVER_CLAIMED,
        action=Action.DEAD.value,
        reason=REPLACED_REASON,
        at=now,
    )


_UNFINISHED_STATUSES = (Status.PENDING.value, Status.RUNNING.value, Status.RETRYING.value)
#: The error type and transition reason of a pending job a newer unique job replaced.
REPLACED = "Replaced"
REPLACED_REASON = "replaced"


#: The attempt id of a job row no attempt has claimed yet (enqueued, or kept from a refused
#: message).
NEVER_CLAIMED = "-"


def get_job(key: str) -> sa.Select[Any]:
    return sa.select(jobs).where(jobs.c.key == key)


def holds_transaction_id(pid: int) -> sa.TextClause:
    """PostgreSQL: whether backend ``pid`` is in a transaction that has a transaction id (it
    wrote or locked rows), so other sessions may wait on it. ``pg_locks`` is readable by any
    role (``pg_stat_activity`` hides other roles' transactions)."""
    return sa.text(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = :pid AND locktype = 'transactionid' "
        "AND mode = 'ExclusiveLock' AND granted)"
    ).bindparams(pid=pid)


def status_and_request(key: str) -> sa.Select[Any]:
    return sa.select(jobs.c.status, jobs.c.request).where(jobs.c.key == key)


def history(key: str) -> sa.Select[Any]:
    return sa.select(transitions).where(transitions.c.key == key).order_by(transitions.c.id)


def last_exit(key: str) -> sa.Select[Any]:
    """The action of the key's newest transition that is not a claim, a lease loss or the retry
    of an interrupted attempt (symptoms, not exits: see ``actions.INTERRUPTED_BY``)."""
    interrupted = (
        transitions.c.action == Action.RETRY_SCHEDULED.value
    ) & transitions.c.reason.like(f"{INTERRUPTED_BY} %")
    return (
        sa.select(transitions.c.action)
        .where(
            (transitions.c.key == key)
            & transitions.c.action.not_in((Action.CLAIMED.value, Action.LOST.value))
            & sa.not_(interrupted)
        )
        .order_by(transitions.c.id.desc())
        .limit(1)
    )


def resends_unclaimed(keys: Sequence[str]) -> sa.Select[Any]:
    """(key, count) of each of ``keys`` recovery re-sent since its newest claim (or ever, if
    never claimed): the re-sent messages nobody has taken yet; a key with none has no row."""
    claims = transitions.alias("claims")
    claimed = (
        sa.select(sa.func.max(claims.c.id))
        .where((claims.c.key == transitions.c.key) & (claims.c.action == Action.CLAIMED.value))
        .scalar_subquery()
    )
    return (
        sa.select(transitions.c.key, sa.func.count())
        .where(
            transitions.c.key.in_(list(keys))
            & (transitions.c.action == Action.RECOVERED.value)
            & (transitions.c.id > sa.func.coalesce(claimed, 0))
        )
        .group_by(transitions.c.key)
    )


def list_jobs(
    *, status: str | None, task_name: str | None, limit: int, never_claimed: bool = False
) -> sa.Select[Any]:
    query = sa.select(jobs).order_by(jobs.c.updated_at.desc()).limit(limit)
    if never_claimed:
        query = query.where((jobs.c.status == Status.PENDING.value) & (jobs.c.generation == 0))
    if status is not None:
        query = query.where(jobs.c.status == status)
    if task_name is not None:
        query = query.where(jobs.c.task_name == task_name)
    return query


def job_status_counts() -> sa.Select[Any]:
    """``(task_name, status, count)`` of every job (the metrics' store gauges)."""
    return sa.select(jobs.c.task_name, jobs.c.status, sa.func.count()).group_by(
        jobs.c.task_name, jobs.c.status
    )


def outbox_status_summary() -> sa.Select[Any]:
    """``(status, count, oldest created_at)`` of the outbox's rows (the metrics' gauges)."""
    return sa.select(outbox.c.status, sa.func.count(), sa.func.min(outbox.c.created_at)).group_by(
        outbox.c.status
    )


def commit_check(
    key: str, generation: int, attempt_id: str, *, now: dt.datetime, in_block: bool = False
) -> Any:
    """A fenced block's ownership check: touch the row where this attempt still owns it
    (:data:`OWNED`). ``in_block`` (PostgreSQL): only inside the transaction the block began
    (:data:`PG_BLOCK_MARKER` still set), never in one a raw COMMIT left behind."""
    where = (
        (jobs.c.key == key)
        & (jobs.c.generation == generation)
        & (jobs.c.attempt_id == attempt_id)
        & (jobs.c.status == Status.RUNNING.value)
    )
    if in_block:
        where = where & (sa.func.current_setting(PG_BLOCK_MARKER, sa.true()) == "on")
    return jobs.update().where(where).values(updated_at=now).returning(jobs.c.generation)


@cache
def _format_dialect(dialect: str) -> sa.Dialect:
    if dialect == "postgresql":
        return pg_dialect.psycopg2.dialect(paramstyle="format")
    return sqlite_dialect.pysqlite.dialect(paramstyle="format")


def format_style(statement: Any, dialect: str) -> tuple[str, list[Any]]:
    """A Core statement as text with ``%s`` placeholders and its parameters, converted as
    SQLAlchemy binds them: for a DB-API cursor that is not SQLAlchemy's (Django's, whose cursors
    take ``%s`` on every backend and hand the values to the driver unchanged)."""
    target = _format_dialect(dialect)
    compiled = statement.compile(dialect=target)
    values = compiled.construct_params()
    params = []
    for name in compiled.positiontup or ():
        value = values[name]
        process = compiled.binds[name].type.dialect_impl(target).bind_processor(target)
        params.append(value if process is None else process(value))
    return str(compiled), params


def stranded(
    *,
    unfinished: Sequence[str],
    cutoff: dt.datetime,
    limit: int,
    task_name: str | None,
    after: tuple[dt.datetime, str] | None = None,
    running_cutoff: dt.datetime | None = None,
) -> sa.Select[Any]:
    """Unfinished jobs unchanged since ``cutoff`` (a ``retrying`` one, or a ``pending`` one
    enqueued with a countdown or eta: due since then too), a ``running`` one since
    ``running_cutoff`` (None: at any age), oldest first; ``after`` (the ``updated_at`` and key
    of the last row of the previous page) pages on."""
    # The statuses as literals, so the planner matches the partial index on the unfinished
    # jobs (a bound parameter would hide them from a generic plan).
    statuses: Any = sa.bindparam(
        "unfinished", tuple(unfinished), expanding=True, literal_execute=True
    )
    running = jobs.c.status == Status.RUNNING.value
    if running_cutoff is not None:
        running = running & (jobs.c.updated_at < running_cutoff)
    retry_due = jobs.c.retry_at.is_(None) | (jobs.c.retry_at < cutoff)
    waits = jobs.c.status.in_((Status.RETRYING.value, Status.PENDING.value))
    query = (
        sa.select(jobs)
        .where(
            jobs.c.status.in_(statuses)
            & (running | (waits & (jobs.c.updated_at < cutoff) & retry_due))
        )
        .order_by(jobs.c.updated_at, jobs.c.key)
        .limit(limit)
    )
    if task_name is not None:
        query = query.where(jobs.c.task_name == task_name)
    if after is not None:
        at = sa.bindparam("after_at", after[0], type_=jobs.c.updated_at.type)
        key = sa.bindparam("after_key", after[1], type_=jobs.c.key.type)
        query = query.where(sa.tuple_(jobs.c.updated_at, jobs.c.key) > sa.tuple_(at, key))
    return query


def purge_batch(
    statuses: Sequence[str], finished_before: dt.datetime, limit: int
) -> tuple[Any, Callable[[Sequence[str]], Any], Callable[[Sequence[str]], Any]]:
    """Purge in batches: the next ``limit`` keys of finished jobs (oldest first, on the partial
    ``finished_at`` index); given those keys, the delete of the jobs still finished (a job
    requeued meanwhile stays), returning the keys deleted; given those, the delete of their
    history."""
    done = jobs.c.status.in_(tuple(statuses)) & (jobs.c.finished_at < finished_before)
    select = sa.select(jobs.c.key).where(done).order_by(jobs.c.finished_at).limit(limit)

    def delete_jobs(keys: Sequence[str]) -> Any:
        return jobs.delete().where(jobs.c.key.in_(list(keys)) & done).returning(jobs.c.key)

    def delete_history(keys: Sequence[str]) -> tuple[Any, Any]:
        return (
            transitions.delete().where(transitions.c.key.in_(list(keys))),
            steps.delete().where(steps.c.key.in_(list(keys))),
        )

    return select, delete_jobs, delete_history


def delete_all(dialect: str) -> tuple[Any, ...]:
    """Every row of the three tables, children first (the testing plugin's reset). On
    PostgreSQL, a row another transaction has locked is left (``SKIP LOCKED``): a worker of an
    earlier test that is still stopping, or a session the server has not ended yet, must not make
    the reset wait on it."""
    if dialect != "postgresql":
        return outbox.delete(), transitions.delete(), steps.delete(), jobs.delete()
    return tuple(
        sa.text(
            f"DELETE FROM {table} WHERE ctid = ANY(ARRAY("
            f"SELECT ctid FROM {table} FOR UPDATE SKIP LOCKED))"
        )
        for table in (OUTBOX, TRANSITIONS, STEPS, JOBS)
    )


# -- the beat scheduler's ticks -------------------------------------------------------------------


def beat_tick_advance(dialect: str, *, entry: str, scheduled: dt.datetime, now: dt.datetime) -> Any:
    """Record ``scheduled`` as ``entry``'s last fired tick, only forward: inserted when the entry
    has no row, updated only when the stored tick is older (never an unconditional write).
    RETURNING gives the row when it moved, nothing when a later tick was already stored."""
    insert = (
        pg_dialect.insert(beat_ticks)
        if dialect == "postgresql"
        else sqlite_dialect.insert(beat_ticks)
    )
    stmt = insert.values(entry=entry, last_scheduled=scheduled, updated_at=now)
    return stmt.on_conflict_do_update(
        index_elements=[beat_ticks.c.entry],
        set_={
            "last_scheduled": stmt.excluded.last_scheduled,
            "updated_at": stmt.excluded.updated_at,
        },
        where=beat_ticks.c.last_scheduled < stmt.excluded.last_scheduled,
    ).returning(beat_ticks.c.entry)


def beat_ticks_of(entries: Sequence[str] | None = None) -> sa.Select[Any]:
    query = sa.select(beat_ticks).order_by(beat_ticks.c.entry)
    if entries is not None:
        query = query.where(beat_ticks.c.entry.in_(list(entries)))
    return query
