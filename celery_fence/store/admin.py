"""The operator's and the recovery's verbs on jobs: requeue a dead job (and undo it when its
message cannot be sent), find stranded jobs and take them for a re-send (one that cannot be
re-sent ends as :class:`~celery_fence.store.records.DeadStranded`), purge finished jobs; and the
operator's reads (:meth:`JobAdmin.list_jobs`, :meth:`JobAdmin.status_counts`). Each write
is a compare-and-set on the row as it was read (:func:`as_read`), through the one fenced write
(:mod:`.fenced`). A store's are ``store.admin`` (:class:`JobAdmin`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery_fence.actions import Action
from celery_fence.errors import StoreError
from celery_fence.schema import COMPLETED, DEAD, FAILED, PENDING, RETRYING, RUNNING, utcnow
from celery_fence.store import sql
from celery_fence.store.records import (
    ENCODED_REQUEST,
    JobRecord,
    job_record,
    run_of,
    with_run,
)

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store

#: Statuses of a job that is not finished: each needs a live lease, a pending retry time or a
#: message on its way, or it is stranded (:meth:`stranded`).
UNFINISHED = (RUNNING, RETRYING, PENDING)


def as_read(store: Store, before: JobRecord, **values: Any) -> dict[str, Any]:
    """Parameters of a compare-and-set on ``before``, the row as read (``requeue``,
    ``take_for_resend``, ...)."""
    return {
        "key": before.key,
        "generation": before.generation,
        "attempt_id": before.attempt_id,
        "was_status": before.status,
        "was_updated_at": store.db.stamp(before.updated_at),
        **values,
    }


#: How JSON writes the NUL character, which PostgreSQL's jsonb refuses.
NUL_ESCAPE = "\\u0000"

#: Jobs deleted (with their history) in one purge transaction.
PURGE_BATCH = 1000


class JobAdmin:
    """The operator's and the recovery's verbs on one store's jobs: ``store.admin``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def requeue(self, key: str, *, completed: bool = False, reason: str | None = None) -> JobRecord:
        """Move a dead job to ``pending`` with a fresh attempt budget; refuse any other status.
        ``reason`` is the ``requeued`` transition's (default: ``by operator``).

        ``completed=True`` does the same to a completed job instead (an operator runs its key again
        on purpose): its stored result stays until the new attempt's completion replaces it, and the
        history records the re-run. The re-run is numbered: its stored request gets the
        :data:`~celery_fence.store.records.RUN_HEADER` header (1, then 2, ...), which the re-sent
        message carries, so the run's outbox effects get idempotency keys of their own. Returns
        the job as it was, with that request (what to re-send). The write is conditional on the
        row still being that record (status, generation and attempt), so two operators cannot
        both requeue it and a requeue never touches a job someone else changed.
        """
        before = self.store.get(key)
        if before is None:
            raise StoreError(f"no job with key {key!r}")
        wanted = COMPLETED if completed else DEAD
        if before.status == FAILED and not completed:
            raise StoreError(
                f"job {key!r} is failed, not dead: not requeued. A direct call or an eager run "
                "raised to its caller, and no message waits for it; call the task again or send "
                "it (.delay()): the next call or message for the key runs it"
            )
        if before.status != wanted:
            raise StoreError(f"job {key!r} is {before.status}, not {wanted}: not requeued")
        params = as_read(self.store, before)
        name = "requeue"
        if completed and before.request:
            request = with_run(before.request, run_of(before.request) + 1)
            text = json.dumps(request, separators=(",", ":"))
            if NUL_ESCAPE in text:  # as a registration stores what jsonb refuses: encoded
                text = json.dumps({ENCODED_REQUEST: text}, separators=(",", ":"))
            params["request"] = text
            name = "requeue_rerun"
            before = dataclasses.replace(before, request=request)
        if completed:  # a run from scratch: the completed run's steps and checkpoint go first
            self.store.steps.clear_completed(key)
        statement = self.store.queries[name]
        if reason is None:
            reason = "completed job re-run by operator" if completed else "by operator"
        self.store.fenced_write("requeue", statement, params, Action.REQUEUED, reason=reason)
        return before

    def restore_finished(self, before: JobRecord, *, reason: str) -> None:
        """Undo :meth:`requeue` when the message could not be sent: back to ``dead`` (or
        ``completed``) as it was.

        Fenced on the requeued row (``pending``, same generation and attempt): if an attempt
        claimed the job meanwhile, nothing changes and :class:`StaleGeneration` says so.
        """
        params = as_read(
            self.store,
            before,
            was_status=PENDING,
            status=before.status,
            attempts=before.attempts,
            finished_at=self.store.db.stamp(before.finished_at),
        )
        statement = self.store.queries["restore_finished"]
        self.store.fenced_write(
            "restore", statement, params, Action.REQUEUE_REVERTED, reason=reason
        )

    def stranded(
        self,
        *,
        older_than: float,
        limit: int = 1000,
        task_name: str | None = None,
        now: dt.datetime | None = None,
        statuses: Sequence[str] = UNFINISHED,
        after: tuple[dt.datetime, str] | None = None,
        running_older_than: float | None = None,
    ) -> Sequence[JobRecord]:
        """Unfinished jobs (``running``, ``retrying``, ``pending``; or those of ``statuses``)
        that have not moved for ``older_than`` seconds, oldest first: ``updated_at`` before the
        cutoff and, for a ``retrying`` job, its ``retry_at`` too. A ``running`` job is judged by
        ``running_older_than`` (None: ``older_than``; 0: at any age). ``after`` (the last row's
        ``(updated_at, key)``) gives the next page. Whether a live lease still holds one is for
        the caller to ask Redis, after this read (:func:`celery_fence.ops.recovery.stranded_jobs`:
        a claim takes its lease before it registers, so a row read ``running`` had its lease
        set before the read)."""
        unknown = set(statuses) - set(UNFINISHED)
        if unknown:
            raise StoreError(f"stranded jobs are unfinished ({', '.join(UNFINISHED)}): {unknown}")
        now = now or utcnow()
        cutoff = now - dt.timedelta(seconds=older_than)
        running = older_than if running_older_than is None else running_older_than
        query = sql.stranded(
            unfinished=tuple(statuses),
            cutoff=cutoff,
            running_cutoff=now - dt.timedelta(seconds=running) if running > 0 else None,
            limit=limit,
            task_name=task_name,
            after=after,
        )
        with self.store.db.connect() as conn:
            return [job_record(r) for r in conn.execute(query).all()]

    def resends_unclaimed(self, keys: Sequence[str]) -> dict[str, int]:
        """How many times recovery re-sent each of ``keys`` since its newest claim, as far as the
        history says (0 with ``fence_record_transitions`` off), in one statement."""
        if not keys:
            return {}
        with self.store.db.connect() as conn:
            counts: dict[str, int] = dict(conn.execute(sql.resends_unclaimed(keys)).tuples().all())
        return {key: int(counts.get(key, 0)) for key in keys}

    def take_for_resend(self, before: JobRecord, *, reason: str) -> JobRecord | None:
        """Move an unfinished job that is about to be re-sent to ``pending`` — only if it is
        still exactly ``before`` (status, generation, attempt and ``updated_at``): of two
        recoveries racing for it, one gets the row and the other None, so one of them sends.

        The attempt count is kept (a job that keeps stranding still ends ``dead``); the owner
        attempt, if it is alive after all, can no longer write: its fenced writes need
        ``running``. If the send that follows never happens, the row is ``pending`` with a
        fresh ``updated_at``, and the next recovery past the threshold takes it again.
        """
        if before.status not in UNFINISHED:
            raise StoreError(f"job {before.key!r} is {before.status}: only unfinished jobs")
        statement = self.store.queries["take_for_resend"]
        actions = (Action.RECOVERED,)
        now = utcnow()
        params = as_read(self.store, before)
        if (
            self.store.writer.write(statement, params, actions=actions, reason=reason, now=now)
            is None
        ):
            return None
        return dataclasses.replace(before, status=PENDING, updated_at=now, retry_at=None)

    def list_jobs(
        self,
        *,
        status: str | None = None,
        task_name: str | None = None,
        limit: int = 50,
        never_claimed: bool = False,
    ) -> list[JobRecord]:
        """Jobs, most recently updated first (``never_claimed``: only ``pending`` ones at
        generation 0, enqueued and not yet claimed)."""
        query = sql.list_jobs(
            status=status, task_name=task_name, limit=limit, never_claimed=never_claimed
        )
        with self.store.db.connect() as conn:
            return [job_record(r) for r in conn.execute(query).all()]

    def status_counts(self) -> dict[tuple[str, str], int]:
        """``{(task_name, status): jobs}``, one grouped read (the metrics' store gauges)."""
        with self.store.db.connect() as conn:
            return {(r[0], r[1]): int(r[2]) for r in conn.execute(sql.job_status_counts()).all()}

    def delete_all_rows(self) -> None:
        """Delete every job, transition and outbox row (on PostgreSQL, every one no open
        transaction has locked): the testing plugin's reset between tests that share a
        PostgreSQL schema (no CLI verb calls it)."""
        with self.store.db.tx(unbounded=True) as conn:
            for statement in sql.delete_all(self.store.dialect):
                conn.execute(statement)

    def purge(
        self,
        *,
        finished_before: dt.datetime,
        statuses: Sequence[str] = (COMPLETED, DEAD),
        batch_size: int = PURGE_BATCH,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete finished jobs of ``statuses`` (and their history) finished before the date, oldest
        first, ``batch_size`` jobs a transaction: no transaction holds locks for long, and a purge
        that is stopped keeps what it deleted and goes on where it was when run again.

        ``progress(total)`` is called after each batch. Outbox rows are left to the outbox's own
        lifecycle. Returns the number of jobs deleted.
        """
        unfinished = set(statuses) - {COMPLETED, DEAD}
        if unfinished:
            raise StoreError(f"only finished jobs are purged, not {sorted(unfinished)}")
        if batch_size < 1:
            raise StoreError(f"purge batch size must be at least 1, not {batch_size}")
        select, delete_jobs, delete_history = sql.purge_batch(statuses, finished_before, batch_size)
        total = 0
        while True:
            with self.store.db.tx() as conn:  # bounded like every store call: one short batch
                keys = [row[0] for row in conn.execute(select)]
                if keys:
                    deleted = [row[0] for row in conn.execute(delete_jobs(keys))]
                    if deleted:
                        for statement in delete_history(deleted):  # history, steps
                            conn.execute(statement)
                    total += len(deleted)
            if keys and progress is not None:
                progress(total)
            if len(keys) < batch_size:
                return total
