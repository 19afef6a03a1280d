"""The one fenced write: a conditional statement, its transition row(s) and its staged outbox
rows, atomically.

Every write on a fenced path (register, an ending of a job, requeue, recover, ...) is one named
statement of :file:`queries.sql` whose condition names the key, the generation and the attempt
(or the state just read). On PostgreSQL the transition rows and outbox rows ride in the same
statement as data-modifying CTEs: one round trip, one prepared statement, on an AUTOCOMMIT
connection. On
SQLite they share one ``BEGIN IMMEDIATE`` transaction. "No row returned" comes back as None, for
the caller to turn into a domain error; it is never followed by an unconditional write.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from celery_fence.actions import Action
from celery_fence.schema import utcnow
from celery_fence.store import queries, session_sql
from celery_fence.store.engine import SQLITE_TIMESTAMP, Database
from celery_fence.store.records import Effect


class Row(NamedTuple):
    """What a fenced write returns."""

    key: str
    generation: int
    attempt_id: str
    attempts: int
    #: A registration's: the re-run number its stored request carries (``register``).
    run: Any = None
    #: A PostgreSQL registration's: when the running row of another attempt it took over last
    #: moved (``register``), else None.
    took_over_from: Any = None


class FencedWriter:
    """Runs fenced writes and transition records on ``db``, with ``statements`` (its dialect's
    named statements: the transition, outbox and commit parts); ``record_transitions`` off
    writes no transition rows (the state changes stay fenced)."""

    def __init__(
        self, db: Database, statements: queries.Rendered, *, record_transitions: bool
    ) -> None:
        self.db = db
        self.statements = statements
        self.record_transitions = record_transitions

    def write(
        self,
        statement: str,
        params: dict[str, Any],
        *,
        actions: tuple[Action, ...],
        reason: str | None = None,
        effects: Sequence[Effect] = (),
        now: dt.datetime | None = None,
        durable: bool = True,
        clear_steps: bool = False,
    ) -> Row | None:
        """Run ``statement`` (with ``params``, and ``now``: the time it writes, by default this
        moment) and, only when it changed a row, a transition row per action and the staged
        ``effects``. Returns the changed row, or None when the condition did not match.

        ``durable`` (PostgreSQL): True, the commit waits for its local WAL flush even where
        ``synchronous_commit`` was turned off for the server, database or role; False (the
        registration only), it returns before its WAL is flushed (``synchronous_commit`` off for
        this statement's transaction): a crash of the database can then lose it, never half of
        it. SQLite: True, the commit syncs the WAL to disk (``synchronous=FULL`` for this write);
        False, the connection's ``synchronous=NORMAL`` (an OS crash can lose it): docs/design.md.
        ``clear_steps``: when it changed a row, the key's steps and checkpoint are deleted in the
        same statement (PostgreSQL) or transaction (SQLite)."""
        now = now or utcnow()
        record = self.record_transitions
        reason = (reason or "")[:255] or None  # the table keeps 255 characters, no empty one
        if self.db.dialect == "postgresql":
            params["now"] = now
            # every fenced write says how durable its commit is (a one-time filter)
            statement = self.statements.with_records(
                statement,
                transition=record,
                effects=bool(effects),
                durable=durable,
                clear_steps=clear_steps,
            )
            (action,) = actions  # one transition row per fenced write on PostgreSQL
            params["action"] = action.value
            params["reason"] = reason
            if effects:
                params["effects"] = json.dumps(
                    [
                        {"name": e.name, "idempotency_key": e.idempotency_key, "payload": e.payload}
                        for e in effects
                    ],
                    separators=(",", ":"),
                )
            row = self.db.pg_execute(statement, params)
            return None if row is None else Row(*row)
        params["now"] = now.strftime(SQLITE_TIMESTAMP)
        # An ending is synced to disk at its commit; inside the caller's open transaction (a
        # rolled-back view: the store's probe) the pragma would change nothing: not set there.
        synced = durable and not self.db.pinned
        with self.db.raw() as cursor:
            if synced:
                cursor.execute(self.statements["sync_ending"])
            try:
                return self._sqlite_write(
                    cursor, statement, params, actions, reason, effects, clear_steps
                )
            finally:
                if synced:
                    cursor.execute(self.statements["sync_default"])

    def _sqlite_write(
        self,
        cursor: Any,
        statement: str,
        params: dict[str, Any],
        actions: tuple[Action, ...],
        reason: str | None,
        effects: Sequence[Effect],
        clear_steps: bool = False,
    ) -> Row | None:
        record = self.record_transitions
        stamp = params["now"]
        # Its rows share one BEGIN IMMEDIATE transaction; a lone statement needs none, nor a
        # write inside the caller's open transaction.
        own_tx = (record or bool(effects) or clear_steps) and not self.db.pinned
        if own_tx:
            cursor.execute(session_sql.BEGIN_IMMEDIATE)
        try:
            cursor.execute(statement, params)
            row = cursor.fetchone()
            if row is not None:
                for action in actions if record else ():
                    cursor.execute(
                        self.statements["transition"],
                        {
                            "key": row[0],
                            "generation": row[1],
                            "attempt_id": row[2],
                            "action": action.value,
                            "reason": reason,
                            "now": stamp,
                        },
                    )
                for e in effects:
                    cursor.execute(
                        self.statements["outbox_insert"],
                        {
                            "key": row[0],
                            "name": e.name,
                            "idempotency_key": e.idempotency_key,
                            "payload": json.dumps(e.payload, separators=(",", ":")),
                            "now": stamp,
                        },
                    )
                if clear_steps:
                    cursor.execute(self.statements["clear_steps"], {"key": row[0]})
        except BaseException:
            if own_tx:
                cursor.execute(session_sql.ROLLBACK)
            raise
        if own_tx:
            cursor.execute(session_sql.COMMIT)
        return None if row is None else Row(*row)

    def record(
        self,
        key: str,
        generation: int | None,
        attempt_id: str | None,
        action: Action | str,
        reason: str | None,
    ) -> None:
        """A transition row that is not a state change of the job (lease lost, stale, busy)."""
        if not self.record_transitions:
            return
        params = _transition(key, generation, attempt_id, action, _reason(reason), None)
        if self.db.dialect == "postgresql":
            params["now"] = utcnow()
            self.db.pg_execute(self.statements["transition"], params)
            return
        params["now"] = self.db.stamp(utcnow())
        with self.db.raw() as cursor:
            cursor.execute(self.statements["transition"], params)


def _reason(reason: str | None) -> str | None:
    """The transitions table keeps 255 characters of a reason, and no empty one."""
    return (reason or "")[:255] or None


def _transition(
    key: str,
    generation: int | None,
    attempt_id: str | None,
    action: Action | str,
    reason: str | None,
    now: Any,
) -> dict[str, Any]:
    return {
        "key": key,
        "generation": generation,
        "attempt_id": attempt_id,
        "action": str(action),
        "reason": reason,
        "now": now,
    }
