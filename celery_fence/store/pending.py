"""What ``enqueue()`` writes (``store.pending``): a job's ``pending`` row, and its uniqueness
key, on the caller's connection and in the caller's transaction, so the job exists exactly when
the caller's own writes commit (:mod:`celery_fence.durable`, :mod:`celery_fence.adapters.unique`,
:mod:`celery_fence.contrib.django.durable`)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_fence.schema import utcnow
from celery_fence.store import sql
from celery_fence.store.records import JobRecord, decode_request, job_record

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store


class PendingRows:
    """The enqueue verbs of one :class:`~celery_fence.store.Store` (``store.pending``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def insert(
        self,
        conn: sa.Connection,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any],
        due: dt.datetime | None = None,
        unique_key: str | None = None,
    ) -> tuple[bool, JobRecord | None]:
        """Write an enqueued job as ``pending`` on the caller's ``conn``, in the caller's
        transaction (``due``: when its countdown or eta ends; recovery waits for it):
        ``(True, None)``; or, when the key already has a job, nothing and ``(False, that job)``
        as this transaction sees it. With ``unique_key``, also nothing when an unfinished job
        holds that uniqueness key: ``(False, that holder)``."""
        statement = self._insert(key, task_name, request, due, unique_key)
        if conn.execute(statement).first() is not None:
            return True, None
        row = None
        if unique_key is not None:
            row = conn.execute(sql.unique_holder(unique_key)).first()
        if row is None:
            row = conn.execute(sql.get_job(key)).first()
        return False, None if row is None else job_record(row)

    def _insert(
        self,
        key: str,
        task_name: str,
        request: Mapping[str, Any],
        due: dt.datetime | None,
        unique_key: str | None,
    ) -> Any:
        """The one statement both inserts run: the ``pending`` row, written now."""
        return sql.insert_pending(
            self.store.dialect,
            key=key,
            task_name=task_name,
            request=dict(request),
            now=utcnow(),
            due=due,
            unique_key=unique_key,
        )

    def unique_holder(self, conn: sa.Connection, unique_key: str) -> JobRecord | None:
        """The unfinished job holding ``unique_key``, if any (as ``conn`` sees it)."""
        row = conn.execute(sql.unique_holder(unique_key)).first()
        return None if row is None else job_record(row)

    def release_unique(
        self, conn: sa.Connection, key: str, *, unique_key: str, status: str
    ) -> bool:
        """Take ``unique_key`` off job ``key`` if it is still in ``status`` (on ``conn``, in
        the caller's transaction); the job runs on, no longer unique. True when it was."""
        return bool(conn.execute(sql.release_unique(key, unique_key, status)).rowcount)

    def replace(self, conn: sa.Connection, key: str, *, unique_key: str) -> bool:
        """End job ``key`` as ``dead`` (reason ``replaced``) if nobody has claimed it yet (on
        ``conn``, in the caller's transaction). True when it was pending and is now dead."""
        now = utcnow()
        if not conn.execute(sql.replace_pending(key, unique_key, now)).rowcount:
            return False
        if self.store.record_transitions:
            conn.execute(sql.replaced_transition(key, now))
        return True

    def insert_cursor(
        self,
        cursor: Any,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any],
        due: dt.datetime | None = None,
    ) -> tuple[bool, str | None, Mapping[str, Any] | None]:
        """:meth:`insert` on a DB-API cursor that is not SQLAlchemy's (a Django cursor on
        the store's database, in the caller's transaction), the same statement in ``%s`` style:
        ``(True, None, None)``, or ``(False, status, request)`` of the key's existing job."""
        statement = self._insert(key, task_name, request, due, None)
        cursor.execute(*sql.format_style(statement, self.store.dialect))
        if cursor.fetchone() is not None:
            return True, None, None
        found = self.status_and_request_cursor(cursor, key)
        if found is None:
            return False, None, None
        return False, found[0], found[1]

    def status_and_request_cursor(
        self, cursor: Any, key: str
    ) -> tuple[str, Mapping[str, Any] | None] | None:
        """The key's job's status and stored request, read on a DB-API cursor that is not
        SQLAlchemy's (Django's); None when the key has no job."""
        cursor.execute(*sql.format_style(sql.status_and_request(key), self.store.dialect))
        row = cursor.fetchone()
        if row is None:
            return None
        stored = json.loads(row[1]) if isinstance(row[1], (str, bytes)) else row[1]
        return str(row[0]), decode_request(stored)


__all__ = ["PendingRows"]
