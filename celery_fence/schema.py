"""The tables. ``metadata`` is exported so users' own Alembic environments can include it.

- ``fence_jobs``: one row per logical key; the generation fence and the single result live here.
- ``fence_transitions``: the history of a key (claimed, completed, stale, retry, dead, ...), no
  payloads; written in the same statement or transaction as the state change it records.
- ``fence_outbox``: external effects staged by a completed job, each with a stable idempotency key.
- ``fence_steps``: the completed steps of a job (``fence.step()``) and its checkpoint
  (``fence.checkpoint()``, the reserved name :data:`CHECKPOINT`), each written by a fenced
  statement; deleted by the job's completion (in its statement), a re-run from scratch
  (``requeue --completed``) or a purge.
- ``fence_beat_ticks``: the last tick each beat entry fired (:mod:`celery_fence.beat`), moved only
  forward.
"""

from __future__ import annotations

import datetime as dt
import random
import time
from enum import Enum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

metadata = sa.MetaData()


def utcnow() -> dt.datetime:
    """Every timestamp celery-fence writes: timezone-aware UTC."""
    return dt.datetime.now(dt.timezone.utc)


#: BIGSERIAL on PostgreSQL, INTEGER PRIMARY KEY (the rowid) on SQLite.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


class UtcTimestamp(sa.types.TypeDecorator[dt.datetime]):
    """A ``timestamptz`` on PostgreSQL, text on SQLite, written as a UTC instant on both: an
    aware value in any zone is converted to UTC (SQLite keeps no offset, so a value stored as
    its wall time would move by its offset), a naive one is taken as UTC (as Celery reads a
    naive ``eta``, and as PostgreSQL would not: it would read it in the session's zone)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: sa.Dialect) -> Any:
        return as_utc(value) if isinstance(value, dt.datetime) else value


def as_utc(value: dt.datetime) -> dt.datetime:
    """``value`` as an aware UTC datetime (naive: taken as UTC)."""
    if value.tzinfo is None or value.utcoffset() is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc)


Timestamp = UtcTimestamp()

KEY_LENGTH = 512


def valid_key(key: Any) -> bool:
    """Whether ``key`` can be a job's fence key: a non-empty str of at most :data:`KEY_LENGTH`
    characters without NUL."""
    return isinstance(key, str) and bool(key) and len(key) <= KEY_LENGTH and "\x00" not in key


class Status(str, Enum):
    """A job's status. ``completed`` and ``dead`` are terminal (until an operator requeues the
    job); ``pending`` is a job waiting for a message that :func:`~celery_fence.enqueue`, an
    operator or a recovery sent; ``failed`` is an attempt run in the caller's thread (a direct
    call, ``.apply()``, an eager run) that raised to its caller: no message waits for it, so
    recovery leaves it, and the next call or message for the key runs it again."""

    RUNNING = "running"
    RETRYING = "retrying"
    COMPLETED = "completed"
    DEAD = "dead"
    PENDING = "pending"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class OutboxStatus(str, Enum):
    """An outbox row's status: ``dead`` rows wait for an operator
    (``store.outbox_rows.requeue(row_id)``; there is no CLI verb for it)."""

    PENDING = "pending"
    DELIVERED = "delivered"
    DEAD = "dead"

    def __str__(self) -> str:
        return self.value


#: The statuses as plain strings (what the driver binds and what rows read back hold).
RUNNING, RETRYING, COMPLETED, DEAD, PENDING, FAILED = (s.value for s in Status)
STATUSES = tuple(s.value for s in Status)
FINISHED_PREDICATE = f"status IN ('{COMPLETED}', '{DEAD}')"
UNFINISHED_PREDICATE = f"status IN ('{RUNNING}', '{RETRYING}', '{PENDING}')"
UNIQUE_PREDICATE = f"unique_key IS NOT NULL AND {UNFINISHED_PREDICATE}"

jobs = sa.Table(
    "fence_jobs",
    metadata,
    sa.Column("key", sa.String(KEY_LENGTH), primary_key=True),
    sa.Column("task_name", sa.String(255), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("result", Json, nullable=True),
    sa.Column("request", Json, nullable=True),
    sa.Column("error_type", sa.String(255), nullable=True),
    sa.Column("error_message", sa.Text, nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("finished_at", Timestamp, nullable=True),
    sa.Column("retry_at", Timestamp, nullable=True),
    # a unique job's uniqueness key (enqueue(unique=...), fence_unique): NULL for other jobs
    sa.Column("unique_key", sa.String(KEY_LENGTH), nullable=True),
    # purge's predicate; partial, so the planner never takes it for a completion's key lookup
    sa.Index(
        "ix_fence_jobs_finished",
        "finished_at",
        postgresql_where=sa.text(FINISHED_PREDICATE),
        sqlite_where=sa.text(FINISHED_PREDICATE),
    ),
    sa.Index("ix_fence_jobs_task_status", "task_name", "status"),
    # the stranded scan (recover, ls --stuck): the few unfinished jobs, oldest move first
    sa.Index(
        "ix_fence_jobs_unfinished",
        "updated_at",
        postgresql_where=sa.text(UNFINISHED_PREDICATE),
        sqlite_where=sa.text(UNFINISHED_PREDICATE),
    ),
    # one unfinished job per uniqueness key: held while the job is pending, running or retrying,
    # released by its own end (completed, dead), never by a TTL
    sa.Index(
        "ux_fence_jobs_unique_unfinished",
        "unique_key",
        unique=True,
        postgresql_where=sa.text(UNIQUE_PREDICATE),
        sqlite_where=sa.text(UNIQUE_PREDICATE),
    ),
)

transitions = sa.Table(
    "fence_transitions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(KEY_LENGTH), nullable=False),
    sa.Column("generation", sa.BigInteger, nullable=True),
    sa.Column("attempt_id", sa.String(64), nullable=True),
    sa.Column("action", sa.String(32), nullable=False),
    sa.Column("reason", sa.String(255), nullable=True),
    sa.Column("at", Timestamp, nullable=False),
    sa.Index("ix_fence_transitions_key_id", "key", "id"),
)

outbox = sa.Table(
    "fence_outbox",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(KEY_LENGTH), nullable=False),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("idempotency_key", sa.String(128), nullable=False, unique=True),
    sa.Column("payload", Json, nullable=True),
    sa.Column("status", sa.String(16), nullable=False),  # pending, delivered, dead
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("available_at", Timestamp, nullable=False),
    sa.Column("claimed_by", sa.String(64), nullable=True),
    sa.Column("claimed_until", Timestamp, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("delivered_at", Timestamp, nullable=True),
    sa.Index("ix_fence_outbox_status_available", "status", "available_at"),
    sa.Index("ix_fence_outbox_key", "key"),
)

#: The reserved step name of a job's checkpoint (step names may not start with ``@``).
CHECKPOINT = "@checkpoint"
STEP_NAME_LENGTH = 255

steps = sa.Table(
    "fence_steps",
    metadata,
    sa.Column("key", sa.String(KEY_LENGTH), primary_key=True),
    sa.Column("name", sa.String(STEP_NAME_LENGTH), primary_key=True),
    sa.Column("generation", sa.BigInteger, nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
    sa.Column("value", Json, nullable=True),
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
)

beat_ticks = sa.Table(
    "fence_beat_ticks",
    metadata,
    sa.Column("entry", sa.String(255), primary_key=True),
    sa.Column("last_scheduled", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
)


def create_schema(engine: sa.Engine) -> None:
    """Create the tables if they do not exist (``celery fence init-db`` does this via Alembic).

    Several processes may do this at once on a fresh database (worker children on the embedded
    SQLite file): one that loses the race between "does it exist?" and "CREATE" gets "already
    exists", and passes again — each pass skips what exists by then — a few times before it
    gives up with the error (anything else than the race fails the same way every pass).
    """
    for attempt in range(1, SCHEMA_PASSES + 1):
        try:
            metadata.create_all(engine)
            return
        except sa.exc.DBAPIError:
            if attempt == SCHEMA_PASSES:
                raise
            time.sleep(random.uniform(0.01, 0.05) * attempt)


#: Passes of :func:`create_schema` before a creation error is raised.
SCHEMA_PASSES = 6
