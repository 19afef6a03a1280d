"""Every statement celery-fence runs against its own tables, per dialect: the one place to read
(or change) its SQL. The store's modules run them (and :mod:`celery_fence.body.transaction` the
block statements, on the user's connection); nothing else builds SQL on these tables.

Two kinds, by how often they run:

- The fenced writes (register, the endings of a job, requeue, recover, steps, ...) are written
  out and named in :file:`queries.sql` (``-- name: complete``), read once at import
  (:data:`STATEMENTS`) and rendered once per dialect (:func:`render`; each driver runs them as
  prepared statements its own way, :meth:`.engine.Database.run_prepared`): they skip
  SQLAlchemy's statement building and compilation, which costs more CPU than the round trip on
  the two that every task runs. Each returns ``(key, generation, attempt_id, attempts)`` of the
  row it changed, or no row when its condition did not match.
  :meth:`Rendered.with_records` wraps one in data-modifying CTEs (named there too) so its
  transition row and staged outbox rows share its statement.
- Reads, operator statements and the outbox's are SQLAlchemy Core, built here per call.

Statuses come from :class:`~celery_fence.schema.Status` and
:class:`~celery_fence.schema.OutboxStatus`, action names from
:class:`~celery_fence.actions.Action`.

The outbox inserts ignore an existing idempotency key: with the fence on, a job completes once, so
this never fires; under the chaos harness's store without the fence (its control arm, whose
statements are its own: :mod:`celery_fence.chaos.arms`), a second (stale) completion then
overwrites the result, as a plain write would, without failing on the outbox.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from celery_fence.actions import INTERRUPTED_BY, Action
from celery_fence.schema import (
    COMPLETED,
    OutboxStatus,
    Status,
    beat_ticks,
    jobs,
    outbox,
    steps,
    transitions,
)

JOBS, TRANSITIONS, OUTBOX, STEPS = jobs.name, transitions.name, outbox.name, steps.name


def render(dialect: str, template: str) -> str:
    """A ``:name`` template in the dialect's parameter style: ``%(name)s`` on PostgreSQL
    (``::type`` casts kept), which psycopg 3 and psycopg2 both take; as is on SQLite, its
    ``::jsonb`` casts dropped (SQLite keeps JSON as text)."""
    if dialect == "sqlite":
        return template.replace("::jsonb", "")
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", template)


# -- session and transaction statements -----------------------------------------------------------

SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA busy_timeout=30000",
)
#: SQLite: a job's ending is synced to disk at its COMMIT: ``sync_ending`` in queries.sql.
BEGIN_IMMEDIATE, COMMIT, ROLLBACK = "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"
NO_STATEMENT_TIMEOUT = "SET LOCAL statement_timeout = 0"


def begin(dialect: str, *, immediate: bool = True) -> str:
    """A transaction's start; on SQLite ``BEGIN IMMEDIATE`` takes the write lock up front."""
    return BEGIN_IMMEDIATE if dialect == "sqlite" and immediate else "BEGIN"


def pg_lock_timeout(ms: int) -> str:
    return f"SET lock_timeout = {int(ms)}"


def pg_block_bounds(idle_ms: int, lock_ms: int, statement_ms: int | None = None) -> str:
    """A fenced block's limits on PostgreSQL, for its transaction only."""
    statement = (
        ""
        if statement_ms is None
        else (f", set_config('statement_timeout', '{int(statement_ms)}', true)")
    )
    return (
        f"SELECT set_config('idle_in_transaction_session_timeout', '{int(idle_ms)}', true), "
        f"set_config('lock_timeout', '{int(lock_ms)}', true){statement}, "
        f"set_config('{PG_BLOCK_MARKER}', 'on', true)"
    )


#: Whether the current PostgreSQL transaction wrote (true/false), by what the server says, never
#: by the statements' text: a transaction that changed data has a transaction id
#: (``pg_current_xact_id_if_assigned()``) and still holds a lock stronger than ``RowShareLock`` on
#: a relation (``RowExclusiveLock`` of an INSERT/UPDATE/DELETE/MERGE/COPY FROM, whatever function,
#: procedure, trigger or ``DO`` block made it; the ``AccessExclusiveLock`` of DDL and TRUNCATE).
#: A transaction that only locked rows (``SELECT ... FOR UPDATE [SKIP LOCKED]``) also has an id,
#: but holds ``RowShareLock`` only: a read. The lock list is read only once an id is assigned
#: (CASE evaluates in order), so a transaction that read costs one function call. PostgreSQL 13+.
PG_TRANSACTION_WROTE = (
    "SELECT CASE WHEN pg_current_xact_id_if_assigned() IS NULL THEN false ELSE EXISTS ("
    "SELECT 1 FROM pg_catalog.pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation' "
    "AND granted AND mode NOT IN ('AccessShareLock', 'RowShareLock')) END"
)
#: :data:`PG_TRANSACTION_WROTE` for PostgreSQL 10 to 12 (``txid_current_if_assigned()``).
PG_TRANSACTION_WROTE_BEFORE_13 = PG_TRANSACTION_WROTE.replace(
    "pg_current_xact_id_if_assigned()", "txid_current_if_assigned()"
)
#: SQLite: the rows this connection changed since it opened (INSERT/UPDATE/DELETE, triggers
#: included; DDL is not counted). A transaction wrote when the count moved since its BEGIN.
SQLITE_TOTAL_CHANGES = "SELECT total_changes()"
#: A transaction-local marker a PostgreSQL ``fence.transaction()`` block sets at its BEGIN
#: (:func:`pg_block_bounds`): still set at the block's commit only if the block's transaction
#: did not end under it (a raw ``COMMIT`` on the block's connection).
PG_BLOCK_MARKER = "celery_fence.block"
PG_BLOCK_MARKER_READ = f"SELECT current_setting('{PG_BLOCK_MARKER}', true)"


def pg_transaction_wrote(server_version: tuple[Any, ...] | None) -> str:
    """:data:`PG_TRANSACTION_WROTE` for a server of ``server_version`` (None: 13 or later)."""
    old = server_version is not None and tuple(server_version[:1]) < (13,)
    return PG_TRANSACTION_WROTE_BEFORE_13 if old else PG_TRANSACTION_WROTE


def pg_statement_timeout(ms: int) -> str:
    """A statement timeout for the rest of the current transaction only."""
    return f"SELECT set_config('statement_timeout', '{int(ms)}', true)"


def sqlite_busy_timeout(ms: int | None = None) -> str:
    """Read (``ms`` None) or set how long an SQLite connection waits for a lock."""
    return "PRAGMA busy_timeout" if ms is None else f"PRAGMA busy_timeout = {int(ms)}"


# -- the fenced writes: written out and named in queries.sql --------------------------------------


def parse_statements(text: str) -> dict[tuple[str, str | None], str]:
    """The blocks of a ``queries.sql`` text: ``{(name, dialect or None): statement}``. A block
    starts at ``-- name: <name>`` or ``-- name: <name> (<dialect>)`` and runs to the next; its
    ``--`` lines are comments (dropped); a name given twice for one dialect is an error."""
    blocks: dict[tuple[str, str | None], str] = {}
    current: tuple[str, str | None] | None = None
    lines: list[str] = []

    def close() -> None:
        if current is not None:
            body = "\n".join(lines).strip()
            if not body:
                raise ValueError(f"queries.sql: statement {current[0]!r} has no text")
            blocks[current] = body

    for line in text.splitlines():
        header = _NAME_LINE.match(line)
        if header is not None:
            close()
            current, lines = (header["name"], header["dialect"]), []
            if current in blocks:
                raise ValueError(f"queries.sql: statement {current[0]!r} given twice")
        elif current is not None and not line.lstrip().startswith("--"):
            lines.append(line.rstrip())
    close()
    return blocks


_NAME_LINE = re.compile(r"^-- name: (?P<name>\w+)(?: \((?P<dialect>postgresql|sqlite)\))?\s*$")


class Statements:
    """The named fenced statements (:file:`queries.sql`), per dialect. ``rendered(dialect)``
    gives each name's text in that dialect's parameter style, rendered once (the store's
    statement cache); :meth:`replaced` gives a set with some texts replaced (the chaos
    harness's control arms: their statements are theirs, never flags of the product's)."""

    def __init__(self, texts: dict[tuple[str, str | None], str]) -> None:
        self.texts = dict(texts)
        self._rendered: dict[str, Rendered] = {}

    def template(self, name: str, dialect: str) -> str:
        """``name``'s text for ``dialect`` as written (``:name`` parameters)."""
        text = self.texts.get((name, dialect)) or self.texts.get((name, None))
        if text is None:
            raise KeyError(f"no statement {name!r} for {dialect} in queries.sql")
        return text

    def names(self, dialect: str) -> list[str]:
        return sorted({n for n, d in self.texts if d in (None, dialect)})

    def replaced(self, texts: dict[tuple[str, str | None], str]) -> Statements:
        """This set with ``texts`` (``{(name, dialect or None): text}``) in place of its own."""
        return Statements({**self.texts, **texts})

    def rendered(self, dialect: str) -> Rendered:
        found = self._rendered.get(dialect)
        if found is None:
            texts = {n: render(dialect, self.template(n, dialect)) for n in self.names(dialect)}
            found = self._rendered[dialect] = Rendered(texts)
        return found


class Rendered(dict[str, str]):
    """One dialect's statements by name, as sent; on PostgreSQL, :meth:`with_records` composes
    (once per shape) a fenced write with the parts that ride along in its statement."""

    def __init__(self, texts: dict[str, str]) -> None:
        super().__init__(texts)
        self._composed: dict[tuple[str, bool, bool, bool, bool], str] = {}

    def with_records(
        self,
        write: str,
        *,
        transition: bool,
        effects: bool,
        durable: bool = True,
        clear_steps: bool = False,
    ) -> str:
        """PostgreSQL: ``write`` (a fenced write's text) in ``WITH fenced AS (...)``, then its
        transition row (``with_transition``: ``%(action)s``, ``%(reason)s``), its outbox rows
        (``with_effects``: ``%(effects)s``) and its steps cleared (``with_cleared_steps``), as
        asked: one statement, one round trip, one commit. Its commit condition:
        ``durable_commit`` (waits for its WAL flush whatever the server's default) or
        ``async_commit`` (it does not), for the statement's own (AUTOCOMMIT) transaction."""
        shape = (write, transition, effects, durable, clear_steps)
        found = self._composed.get(shape)
        if found is None:
            parts = [f"WITH fenced AS ({write})"]
            if transition:
                parts.append(self["with_transition"])
            if effects:
                parts.append(self["with_effects"])
            if clear_steps:
                parts.append(self["with_cleared_steps"])
            parts.append("SELECT * FROM fenced")  # a registration's also its stored run
            parts.append("WHERE " + self["durable_commit" if durable else "async_commit"])
            found = self._composed[shape] = "\n".join(parts)
        return found


def _read_statements() -> Statements:
    text = (resources.files("celery_fence.store") / "queries.sql").read_text(encoding="utf-8")
    return Statements(parse_statements(text))


#: The fenced statements of :file:`queries.sql`, read once at import.
STATEMENTS = _read_statements()
#: The fence, as every fenced write of the task's path says it (:file:`queries.sql`).
OWNED = (
    "key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'"
)
#: A registration's condition: a strictly greater generation of a live job.
NEWER_LIVE = (
    "fence_jobs.status NOT IN ('completed', 'dead')\n"
    "    AND fence_jobs.generation < excluded.generation"
)


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


# -- the outbox (SQLAlchemy Core; ``now`` is the database's clock or this process's) -------------


def _due(now: Any) -> Any:
    return (
        (outbox.c.status == OutboxStatus.PENDING.value)
        & (outbox.c.available_at <= now)
        & (outbox.c.claimed_until.is_(None) | (outbox.c.claimed_until < now))
    )


def outbox_dead_exhausted(*, now: Any, max_attempts: int, key: str | None) -> Any:
    exhausted = _due(now) & (outbox.c.attempts >= max_attempts)
    if key is not None:
        exhausted = exhausted & (outbox.c.key == key)
    return (
        outbox.update()
        .where(exhausted)
        .values(
            status=OutboxStatus.DEAD.value,
            claimed_until=None,
            last_error=(
                f"claimed {max_attempts} time(s) without being marked delivered or failed "
                "(did the handler kill or hang its worker?)"
            ),
        )
        .returning(*outbox.c)
    )


def outbox_claim(
    dialect: str,
    *,
    now: Any,
    until: Any,
    claimer: str,
    limit: int,
    key: str | None,
    after_id: int,
) -> Any:
    """Claim due rows: ``FOR UPDATE SKIP LOCKED`` in one statement on PostgreSQL (a CTE runs
    once: ``id IN (SELECT ... SKIP LOCKED LIMIT n)`` may be re-run per row); the same
    conditional ``UPDATE`` on SQLite, whose caller holds ``BEGIN IMMEDIATE``."""
    due = _due(now) & (outbox.c.id > after_id)
    if key is not None:
        due = due & (outbox.c.key == key)
    ids = sa.select(outbox.c.id).where(due).order_by(outbox.c.id).limit(limit)
    claim = outbox.update().values(
        claimed_by=claimer[:64], claimed_until=until, attempts=outbox.c.attempts + 1
    )
    if dialect == "postgresql":
        picked = ids.with_for_update(skip_locked=True).cte("picked")
        return claim.where(outbox.c.id == picked.c.id).returning(*outbox.c)
    return claim.where(outbox.c.id.in_(ids.scalar_subquery()) & due).returning(*outbox.c)


def outbox_update_claimed(row_id: int, claimer: str, values: dict[str, Any]) -> Any:
    """Set ``values`` on a pending row only while ``claimer`` holds its claim."""
    return (
        outbox.update()
        .where(
            (outbox.c.id == row_id)
            & (outbox.c.claimed_by == claimer[:64])
            & (outbox.c.status == OutboxStatus.PENDING.value)
        )
        .values(**values)
        .returning(outbox.c.id)
    )


def outbox_requeue(ids: Sequence[int] | None, now: Any, key: str | None = None) -> Any:
    """``dead`` rows back to ``pending``, due now, with a fresh attempt count: those of ``ids``
    (None: every dead row, or ``key``'s) that are still ``dead`` when the statement runs."""
    still_dead = outbox.c.status == OutboxStatus.DEAD.value
    if ids is not None:
        still_dead = still_dead & outbox.c.id.in_(list(ids))
    if key is not None:
        still_dead = still_dead & (outbox.c.key == key)
    return (
        outbox.update()
        .where(still_dead)
        .values(
            status=OutboxStatus.PENDING.value,
            attempts=0,
            available_at=now,
            claimed_by=None,
            claimed_until=None,
        )
        .returning(outbox.c.id)
    )


def outbox_statuses(ids: Sequence[int]) -> sa.Select[Any]:
    """``(id, status)`` of the rows of ``ids`` that exist."""
    return sa.select(outbox.c.id, outbox.c.status).where(outbox.c.id.in_(list(ids)))


def outbox_purge(delivered_before: dt.datetime) -> Any:
    return outbox.delete().where(
        (outbox.c.status == OutboxStatus.DELIVERED.value)
        & (outbox.c.delivered_at < delivered_before)
    )


def outbox_rows(
    *, key: str | None, status: str | None, limit: int, newest_first: bool = False
) -> sa.Select[Any]:
    order = outbox.c.id.desc() if newest_first else outbox.c.id
    query = sa.select(outbox).order_by(order).limit(limit)
    if key is not None:
        query = query.where(outbox.c.key == key)
    if status is not None:
        query = query.where(outbox.c.status == status)
    return query


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
