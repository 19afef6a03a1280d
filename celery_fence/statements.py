"""Driver-level SQL for the two statements on every task's critical path: register and complete.

They run once per task, so they skip SQLAlchemy's statement building and compilation (which cost
more CPU than the round trip itself) and go to the driver as prepared text, built once per
(dialect, options). Everything else in :mod:`celery_fence.store` uses SQLAlchemy Core. Only the
store imports this module.

Parameters (psycopg2 ``%(name)s`` / sqlite3 ``:name``): ``key``, ``task_name``, ``generation``,
``attempt_id``, ``request`` and ``result`` (JSON text), ``effects`` (a JSON array of
``{"name", "idempotency_key", "payload"}``, PostgreSQL), ``now``. Each statement returns
``(key, generation, attempt_id, attempts)`` of the row it changed, or no row when its fence
did not match.

The outbox inserts ignore an existing idempotency key: with the fence on, a job completes once, so
this never fires; in the ``fence_unfenced`` demonstration mode a second (stale) completion then
overwrites the result, as a plain write would, without failing on the outbox.
"""

from __future__ import annotations

import os
import re
from functools import cache
from typing import Any

RETURNING = "RETURNING key, generation, attempt_id, attempts"


def _p(dialect: str, name: str) -> str:
    return f"%({name})s" if dialect == "postgresql" else f":{name}"


@cache
def register_sql(dialect: str, *, fenced: bool = True, deferred_first: bool = False) -> str:
    """Upsert that takes the row only for a strictly greater generation of a live job.

    ``deferred_first``: generation 1 is never registered up front (its row is written by its
    completion), so a new row at a generation above 1 also counts that first execution.
    """
    p = lambda n: _p(dialect, n)  # noqa: E731
    first_attempts = "1"
    if deferred_first:  # the cast: a prepared statement must deduce one type per parameter
        first_attempts = f"CASE WHEN CAST({p('generation')} AS BIGINT) > 1 THEN 2 ELSE 1 END"
    json = "::jsonb" if dialect == "postgresql" else ""
    condition = "fence_jobs.status NOT IN ('completed', 'dead')"
    if fenced:
        condition += " AND fence_jobs.generation < excluded.generation"
    return (
        "INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, "
        "request, created_at, updated_at) "
        f"VALUES ({p('key')}, {p('task_name')}, 'running', {p('generation')}, {p('attempt_id')}, "
        f"{first_attempts}, {p('request')}{json}, {p('now')}, {p('now')}) "
        "ON CONFLICT (key) DO UPDATE SET generation = excluded.generation, "
        "attempt_id = excluded.attempt_id, status = 'running', "
        "attempts = fence_jobs.attempts + 1, updated_at = excluded.updated_at, retry_at = NULL "
        f"WHERE {condition} {RETURNING}"
    )


@cache
def complete_sql(dialect: str, *, fenced: bool = True) -> str:
    """Result + completed, only where this attempt still owns a running row."""
    p = lambda n: _p(dialect, n)  # noqa: E731
    json = "::jsonb" if dialect == "postgresql" else ""
    where = f"key = {p('key')}"
    sets = ""
    if fenced:
        where += (
            f" AND generation = {p('generation')} AND attempt_id = {p('attempt_id')} "
            "AND status = 'running'"
        )
    else:  # demonstration mode: last writer wins
        sets = f", generation = {p('generation')}, attempt_id = {p('attempt_id')}"
    return (
        f"UPDATE fence_jobs SET status = 'completed', result = {p('result')}{json}, "
        f"updated_at = {p('now')}, finished_at = {p('now')}, error_type = NULL, "
        f"error_message = NULL{sets} WHERE {where} {RETURNING}"
    )


@cache
def complete_first_sql(dialect: str) -> str:
    """A deferred first claim's completion: the row inserted as completed, in one statement,
    only where no row exists. Any row means a newer generation registered (or Redis lost its
    counter and handed out 1 again): nothing is written, and the caller treats it as stale."""
    p = lambda n: _p(dialect, n)  # noqa: E731
    json = "::jsonb" if dialect == "postgresql" else ""
    return (
        "INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, "
        "request, result, created_at, updated_at, finished_at) "
        f"VALUES ({p('key')}, {p('task_name')}, 'completed', {p('generation')}, "
        f"{p('attempt_id')}, 1, {p('request')}{json}, {p('result')}{json}, {p('now')}, "
        f"{p('now')}, {p('now')}) ON CONFLICT (key) DO NOTHING {RETURNING}"
    )


TRANSITION_COLUMNS = "key, generation, attempt_id, action, reason, at"
OUTBOX_COLUMNS = "key, name, idempotency_key, payload, status, attempts, available_at, created_at"


@cache
def pg_with_records(
    write_sql: str, *, action: str | tuple[str, ...], transitions: bool, effects: bool
) -> str:
    """Wrap a write in data-modifying CTEs so its transition rows (one per action, in order) and
    outbox rows share its statement (one round trip, one commit) on PostgreSQL."""
    parts = [f"WITH fenced AS ({write_sql})"]
    actions = (action,) if isinstance(action, str) else action
    if transitions and len(actions) == 1:
        parts.append(
            f", transition AS (INSERT INTO fence_transitions ({TRANSITION_COLUMNS}) "
            f"SELECT key, generation, attempt_id, '{actions[0]}', NULL, %(now)s FROM fenced)"
        )
    elif transitions:  # one INSERT, rows in the actions' order (their ids keep it)
        rows = ", ".join(f"({i}, '{name}')" for i, name in enumerate(actions))
        parts.append(
            f", transition AS (INSERT INTO fence_transitions ({TRANSITION_COLUMNS}) "
            "SELECT f.key, f.generation, f.attempt_id, a.action, NULL, %(now)s FROM fenced f "
            f"CROSS JOIN (VALUES {rows}) AS a(n, action) ORDER BY a.n)"
        )
    if effects:
        parts.append(
            f", effects AS (INSERT INTO fence_outbox ({OUTBOX_COLUMNS}) "
            "SELECT f.key, e.name, e.idempotency_key, e.payload, 'pending', 0, %(now)s, %(now)s "
            "FROM fenced f CROSS JOIN jsonb_to_recordset(%(effects)s::jsonb) "
            "AS e(name text, idempotency_key text, payload jsonb) "
            "ON CONFLICT (idempotency_key) DO NOTHING)"
        )
    parts.append(" SELECT key, generation, attempt_id, attempts FROM fenced")
    return "".join(parts)


def sqlite_transition_sql(action: str) -> str:
    return (
        f"INSERT INTO fence_transitions ({TRANSITION_COLUMNS}) "
        f"VALUES (:key, :generation, :attempt_id, '{action}', NULL, :now)"
    )


SQLITE_OUTBOX_SQL = (
    f"INSERT INTO fence_outbox ({OUTBOX_COLUMNS}) "
    "VALUES (:key, :name, :idempotency_key, :payload, 'pending', 0, :now, :now) "
    "ON CONFLICT (idempotency_key) DO NOTHING"
)


def _positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``%(name)s`` placeholders to ``$1, $2, ...`` (first appearance order) for ``PREPARE``."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, sql), tuple(names)


def execute_prepared(raw: Any, cursor: Any, sql: str, params: dict[str, Any]) -> Any:
    """Run ``sql`` on PostgreSQL as a server-side prepared statement: ``PREPARE`` once per
    connection, then ``EXECUTE`` — the server parses and plans it once, not on every task.
    Returns the first row or None. A connection that lost its prepared statements (a pooler
    that swapped the server connection, ``DISCARD ALL``) prepares again, once."""
    prepared: dict[str, tuple[str, tuple[str, ...]]] = raw.info.setdefault("fence_prepared", {})
    for attempt in (1, 2):
        entry = prepared.get(sql)
        if entry is None:
            text, names = _positional(sql)
            name = f"fence_hot_{len(prepared)}_{os.getpid()}"
            cursor.execute(f"PREPARE {name} AS {text}")
            entry = prepared[sql] = (name, names)
        name, names = entry
        try:
            cursor.execute(
                f"EXECUTE {name} ({', '.join(['%s'] * len(names))})", [params[n] for n in names]
            )
        except Exception as exc:
            if attempt == 1 and getattr(exc, "pgcode", None) == "26000":  # no such statement
                prepared.clear()
                continue
            raise
        return cursor.fetchone()
    raise AssertionError("unreachable")  # pragma: no cover
