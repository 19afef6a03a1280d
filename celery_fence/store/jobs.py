"""The fenced result store: the job verbs of the task's path (register, and :meth:`Store.end`,
which applies every ending of a job), the read of one job; the operator's verbs and reads
(list, counts, stranded) are ``store.admin`` (:class:`.admin.JobAdmin`), the transition reads
``store.transitions`` (:class:`.transitions.TransitionReads`). Its fenced statements are in
:file:`queries.sql` (by name, loaded by :mod:`.queries`), the rest of its SQL in :mod:`.sql`,
its connection in :mod:`.engine`, its one fenced write in :mod:`.fenced`, its outbox in
:mod:`.outbox`."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from celery_fence import schema
from celery_fence.actions import Action
from celery_fence.errors import JobDead, StaleGeneration, StoreError
from celery_fence.schema import COMPLETED, DEAD, RUNNING
from celery_fence.settings import DEFAULT_DATABASE_TIMEOUT
from celery_fence.store import admin, queries, sql
from celery_fence.store.beat import BeatTicks
from celery_fence.store.blocks import Blocks
from celery_fence.store.engine import Database
from celery_fence.store.fenced import FencedWriter, Row
from celery_fence.store.outbox import OutboxRows
from celery_fence.store.pending import PendingRows
from celery_fence.store.records import (
    ENCODED_REQUEST,
    CallerFailed,
    Completion,
    Dead,
    DeadRefused,
    DeadStranded,
    DeadUnregistered,
    DeadUnrun,
    Effect,
    Ending,
    JobRecord,
    Registration,
    RetryScheduled,
    dumps_strict,
    job_record,
    run_value,
)
from celery_fence.store.steps import StepRows
from celery_fence.store.transitions import TransitionReads


class Store:
    """The SQL repository of jobs, their transitions and their outbox rows. Safe to share between
    threads; re-creates its pool after fork."""

    #: Its named statements (:file:`queries.sql`); the chaos harness's control arms give their
    #: own (:mod:`celery_fence.chaos.arms`).
    statements: queries.Statements = queries.STATEMENTS
    #: Whether a registration's commit waits for its WAL flush (PostgreSQL). It does not: losing
    #: a registration in a database crash only costs a re-run, and any later commit of the
    #: attempt (a block, the completion) flushes it first. docs/design.md, "One durable commit
    #: per task".
    durable_registration = False
    #: The block verbs' class (the chaos harness's store without the fence replaces it).
    _blocks_class = Blocks

    def __init__(
        self,
        url: str,
        *,
        record_transitions: bool = True,
        error_message_length: int = 500,
        lock_timeout: float = 5.0,
        engine_options: Mapping[str, Any] | None = None,
        database_timeout: float = DEFAULT_DATABASE_TIMEOUT,
    ) -> None:
        self.db = Database(
            url,
            lock_timeout=lock_timeout,
            engine_options=engine_options,
            database_timeout=database_timeout,
        )
        self.url = url
        self.dialect = self.db.dialect
        self.database_timeout = database_timeout
        self.lock_timeout = lock_timeout
        self.record_transitions = record_transitions
        self.error_message_length = error_message_length
        #: The statements by name, in this database's dialect, as sent.
        self.queries = self.statements.rendered(self.dialect)
        self._bind_verbs()

    def _bind_verbs(self) -> None:
        """The verb groups on this store's ``db`` (made again for a view: :meth:`on`)."""
        self.writer = FencedWriter(
            self.db, self.queries, record_transitions=self.record_transitions
        )
        self.outbox_rows = OutboxRows(self)
        #: The completed steps and the checkpoint of each job (``fence_steps``).
        self.steps = StepRows(self)
        #: The beat scheduler's last fired tick per entry (:mod:`celery_fence.beat`).
        self.beat_ticks = BeatTicks(self)
        #: The operator's and the recovery's verbs: requeue, stranded, take_for_resend, purge.
        self.admin = admin.JobAdmin(self)
        #: The store's side of a fenced block (:mod:`.blocks`): its bounds and its commit check.
        self.blocks = self._blocks_class(self)
        #: What ``enqueue()`` writes in the caller's transaction (:mod:`.pending`).
        self.pending = PendingRows(self)
        #: The reads of the transition rows: ``history(key)``, ``last_exit(key)``.
        self.transitions = TransitionReads(self)

    @property
    def engine(self) -> sa.Engine:
        return self.db.engine

    def on(self, db: Database) -> Store:
        """This store's verbs on ``db``, a view of its database (:meth:`Database.rolled_back`)."""
        view = copy.copy(self)
        view.db = db
        view._bind_verbs()
        return view

    def dispose(self) -> None:
        self.db.dispose()

    def create_schema(self) -> None:
        schema.create_schema(self.engine)

    # -- the fenced path ------------------------------------------------------------------------

    def register(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request: Mapping[str, Any] | None = None,
        request_json: str | None = None,
        took_over: bool = False,
    ) -> Registration:
        """Register generation ``generation`` as the owner of ``key`` before the body runs.

        One statement: the row takes (generation, attempt, running) and counts one attempt only
        if ``generation`` is strictly greater than the stored one and the job is neither completed
        nor dead. Otherwise nothing changes and the stored state says why. The registration
        says whether it took over a running row of another attempt (``took_over_from``): on
        PostgreSQL always, from its own statement; on SQLite when ``took_over`` asks (the row
        read first, in process).
        """
        params = {
            "key": key,
            "task_name": task_name,
            "generation": generation,
            "attempt_id": attempt_id,
            "request": request_json
            if request is None
            else json.dumps(request, separators=(",", ":")),
        }
        previous = self.get(key) if took_over and self.dialect != "postgresql" else None
        statement = self.queries["register"]
        row = self.writer.write(
            statement, params, actions=_CLAIMED, durable=self.durable_registration
        )
        if row is not None:
            moved = row.took_over_from  # PostgreSQL: the statement says; SQLite: the row read
            if previous is not None and previous.status == RUNNING and previous.generation > 0:
                moved = None if previous.attempt_id == attempt_id else previous.updated_at
            return Registration(
                "registered",
                row.attempts,
                row.generation,
                run=run_value(row.run),
                took_over_from=moved,
            )
        record = self.get(key)
        if record is None:  # deleted between the two statements (purge): let the caller retry
            raise StoreError(f"job {key!r} vanished during registration; retry")
        if record.status == COMPLETED:
            return Registration("completed", record.attempts, record.generation, record)
        if record.status == DEAD:
            return Registration("dead", record.attempts, record.generation, record)
        return Registration("stale", record.attempts, record.generation, record)

    def _rejected(self, key: str, generation: int, attempt_id: str, what: str) -> StaleGeneration:
        record = self.get(key)
        if record is None:
            detail = "no job row"
        else:
            detail = (
                f"stored generation {record.generation} (attempt {record.attempt_id}), "
                f"status {record.status}"
            )
        return StaleGeneration(
            f"{what} for {key!r} from generation {generation} (attempt {attempt_id}) rejected: "
            f"{detail}",
            key=key,
            generation=generation,
            attempt_id=attempt_id,
            stored_generation=None if record is None else record.generation,
            stored_status=None if record is None else record.status,
        )

    # -- the endings: one value each, one method applies them ----------------------------------

    def end(self, key: str, ending: Ending) -> bool:
        """Apply ``ending`` to ``key``'s job: its one statement (named below, with its
        condition), its transition row and, for a completion, its staged effects, atomically.

        A fenced ending (:data:`~celery_fence.store.records.FENCED_ENDINGS`: the attempt's
        ``generation`` and ``attempt_id``) returns True, or raises :class:`StaleGeneration`
        when its condition did not hold (nothing is stored). The others return whether they
        changed the row.
        """
        match ending:
            case Completion():  # where this attempt owns the running row
                params = self._owner(
                    key,
                    ending.generation,
                    ending.attempt_id,
                    result=dumps_strict(ending.result, "task's return value"),
                )
                statement = self.queries["complete"]
                effects = ending.effects
                self.fenced_write(
                    "completion",
                    statement,
                    params,
                    Action.COMPLETED,
                    effects=effects,
                    clear_steps=ending.clear_steps,
                )
            case RetryScheduled():  # where this attempt owns the running row
                errors = self._error_fields(ending.error)
                params = self._owner(
                    key,
                    ending.generation,
                    ending.attempt_id,
                    retry_at=self.db.stamp(ending.retry_at),
                    **errors,
                )
                statement = self.queries["retry_with_error" if errors else "retry"]
                reason = ending.reason
                self.fenced_write("retry", statement, params, Action.RETRY_SCHEDULED, reason=reason)
            case Dead():  # where this attempt owns the running row
                errors = self._error_fields(ending.error)
                attempts = ending.attempts
                params = self._owner(
                    key, ending.generation, ending.attempt_id, attempts=attempts, **errors
                )
                name = "dead" if attempts is None else "dead_counted"
                statement = self.queries[f"{name}_with_error" if errors else name]
                reason = ending.reason
                self.fenced_write("dead-letter", statement, params, Action.DEAD, reason=reason)
            case CallerFailed():  # where this attempt owns the running row
                errors = self._error_fields(ending.error)
                params = self._owner(key, ending.generation, ending.attempt_id, **errors)
                statement = self.queries["caller_failed_with_error" if errors else "caller_failed"]
                reason = ending.reason
                self.fenced_write("failure", statement, params, Action.FAILED, reason=reason)
            case DeadRefused():  # like a registration: over an older generation of a live job
                request = (
                    None if ending.request_json is None else {ENCODED_REQUEST: ending.request_json}
                )
                params = self._owner(
                    key,
                    ending.generation,
                    ending.attempt_id,
                    task_name=ending.task_name,
                    request=_json(request),
                    **self._error_fields(ending.error),
                )
                statement = self.queries["dead_refused"]
                reason = ending.reason
                self.fenced_write("dead-letter", statement, params, Action.DEAD, reason=reason)
            case DeadUnregistered():  # a new row, or over a pending one
                return self._dead_unregistered(key, ending)
            case DeadUnrun():  # a new row, or compare-and-set on the row waiting for it
                return self._dead_unrun(key, ending)
            case DeadStranded():  # compare-and-set on the row as recovery read it, unmoved
                before = ending.record
                if before.key != key:
                    raise ValueError(f"a stranded job's record of {before.key!r}, not {key!r}")
                params = admin.as_read(self, before, **self._error_fields(ending.error))
                statement = self.queries["dead_stranded"]
                row = self.writer.write(statement, params, actions=_DEAD, reason=ending.reason)
                return row is not None
            case _:
                raise TypeError(f"not an ending: {type(ending).__name__}")
        return True

    def _dead_unregistered(
        self, key: str, ending: DeadUnregistered, *, over_pending: bool = True
    ) -> bool:
        """:class:`DeadUnregistered`: a request the database refuses as is (e.g. ``\\u0000`` in
        PostgreSQL's jsonb) is kept encoded, as :class:`DeadRefused` keeps it.
        ``over_pending=False``: only a new row (``dead_unregistered_new``: a ``pending`` one is
        left to the caller)."""
        params = {
            "key": key,
            "task_name": ending.task_name,
            "request": _json(ending.request),
            **self._error_fields(ending.error),
        }
        statement = self.queries["dead_unregistered" if over_pending else "dead_unregistered_new"]
        reason = ending.reason
        try:
            return self.writer.write(statement, params, actions=_DEAD, reason=reason) is not None
        except sa.exc.DataError:
            if ending.request is None:
                raise
            params["request"] = _json({ENCODED_REQUEST: _json(ending.request)})
            return self.writer.write(statement, params, actions=_DEAD, reason=reason) is not None

    def _dead_unrun(self, key: str, ending: DeadUnrun) -> bool:
        """:class:`DeadUnrun`: a new row (:class:`DeadUnregistered`'s statement, where no row
        exists), else a compare-and-set (``dead_unrun``) on the row just read, while it waits
        for this message (:meth:`DeadUnrun.waits_for`: a ``pending`` row of another message that
        shares the key is not this message's); True when the job went ``dead``, False when only
        the transition is recorded."""
        reason, terminated_id = ending.reason, ending.terminated_id
        error = JobDead(f"the message was {reason} before it ran; requeue the job to run it")
        if terminated_id is not None:
            error = JobDead(f"the attempt was {reason} while it ran; requeue the job to run it")
        unregistered = DeadUnregistered(ending.task_name, ending.request, error, reason)
        if self._dead_unregistered(key, unregistered, over_pending=False):
            return True
        for _ in range(3):  # a claim or registration may move the row between read and write
            before = self.get(key)
            if before is None or not ending.waits_for(before):
                break
            params = self._owner(
                key,
                before.generation,
                before.attempt_id,
                was_status=before.status,
                **self._error_fields(error),
            )
            statement = self.queries["dead_unrun"]
            if self.writer.write(statement, params, actions=_DEAD, reason=reason) is not None:
                return True
            if terminated_id is None:
                break
        note = "message not run" if terminated_id is None else "attempt terminated, job left as is"
        self.record(key, action=reason, reason=note)
        return False

    def fenced_write(
        self,
        what: str,
        statement: str,
        params: dict[str, Any],
        *actions: Action,
        reason: str | None = None,
        effects: Sequence[Effect] = (),
        clear_steps: bool = False,
    ) -> Row:
        """A fenced write that must change this attempt's row (``params``' key, generation and
        attempt): :class:`StaleGeneration` (``what`` ... rejected) when it did not."""
        row = self.writer.write(
            statement,
            params,
            actions=actions,
            reason=reason,
            effects=effects,
            durable=True,
            clear_steps=clear_steps,
        )
        if row is None:
            raise self._rejected(params["key"], params["generation"], params["attempt_id"], what)
        return row

    def _error_fields(self, error: BaseException | None) -> dict[str, Any]:
        if error is None:
            return {}
        message = str(error)
        if len(message) > self.error_message_length:
            message = message[: self.error_message_length - 1] + "…"
        return {
            "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error_message": message,
        }

    def _owner(self, key: str, generation: int, attempt_id: str, **values: Any) -> dict[str, Any]:
        return {"key": key, "generation": generation, "attempt_id": attempt_id, **values}

    def record(
        self,
        key: str,
        *,
        action: Action | str,
        generation: int | None = None,
        attempt_id: str | None = None,
        reason: str | None = None,
    ) -> None:
        """Record a transition that is not itself a SQL state change (lease lost, stale, busy)."""
        self.writer.record(key, generation, attempt_id, action, reason)

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: str) -> JobRecord | None:
        with self.db.connect() as conn:
            row = conn.execute(sql.get_job(key)).first()
        return None if row is None else job_record(row)


def _json(value: Mapping[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


_CLAIMED = (Action.CLAIMED,)
_DEAD = (Action.DEAD,)
