"""A job's completed steps and its checkpoint (``fence_steps``): ``store.steps``.

The writes run on a fenced block's connection, in its transaction (:mod:`celery_fence.body.steps`):
each is one statement conditional on the attempt still owning the running job row
(queries.sql's fence), and the block's commit is fenced again. Values are payloads: never logged;
the operator's view (:meth:`StepRows.rows`) gives their sizes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_fence.schema import RUNNING, utcnow
from celery_fence.store import sql

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One stored step (or the checkpoint, named ``@checkpoint``): who wrote it, when, and the
    size of its JSON value (the value itself only when asked for)."""

    key: str
    name: str
    generation: int
    attempt_id: str
    size: int
    created_at: dt.datetime
    updated_at: dt.datetime
    value: Any = None


@dataclasses.dataclass(frozen=True)
class Boundary:
    """What a step's start reads: whether the attempt still owns the running job, and the step's
    stored value when it completed on an earlier attempt."""

    owner: bool
    done: bool
    value: Any = None


class StepRows:
    """The ``fence_steps`` verbs of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def boundary(
        self, conn: sa.Connection, key: str, name: str, *, generation: int, attempt_id: str
    ) -> Boundary:
        """On ``conn`` (the step's block): does this attempt own the running job, and is the step
        done? One read."""
        row = conn.execute(sql.step_boundary(key, name)).first()
        owner = (
            row is not None
            and row.generation == generation
            and row.attempt_id == attempt_id
            and row.status == RUNNING
        )
        if row is None or row.step_generation is None:
            return Boundary(owner=owner, done=False)
        return Boundary(owner=owner, done=True, value=row.step_value)

    def write_done(
        self,
        conn: sa.Connection,
        key: str,
        name: str,
        value: str,
        *,
        generation: int,
        attempt_id: str,
    ) -> bool:
        """Store the completed step's JSON ``value``, fenced (``step_done``):
        whether it was written."""
        statement = self.store.queries["step_done"]
        params = self._params(key, generation, attempt_id, value, name=name)
        return conn.exec_driver_sql(statement, params).first() is not None

    def write_checkpoint(
        self, conn: sa.Connection, key: str, value: str, *, generation: int, attempt_id: str
    ) -> bool:
        """Store the job's checkpoint, fenced (``checkpoint``): whether it was
        written."""
        statement = self.store.queries["checkpoint"]
        params = self._params(key, generation, attempt_id, value)
        return conn.exec_driver_sql(statement, params).first() is not None

    def value(self, key: str, name: str, conn: sa.Connection | None = None) -> Any:
        """A stored step's value (or the checkpoint's), None when there is none; on ``conn``
        when given (an open block sees its own uncommitted checkpoint)."""
        if conn is not None:
            return conn.execute(sql.step_value(key, name)).scalar()
        with self.store.db.connect() as own:
            return own.execute(sql.step_value(key, name)).scalar()

    def rows(self, key: str, *, values: bool = False) -> list[StepRecord]:
        """The key's steps and checkpoint, oldest first (``values``: with their values)."""
        with self.store.db.connect() as conn:
            rows = conn.execute(sql.steps_of(key)).all()
        return [
            StepRecord(
                key=r.key,
                name=r.name,
                generation=r.generation,
                attempt_id=r.attempt_id,
                size=r.size,
                created_at=r.created_at,
                updated_at=r.updated_at,
                value=r.value if values else None,
            )
            for r in rows
        ]

    def clear_completed(self, key: str) -> int:
        """Delete a completed job's steps and checkpoint (only while it is completed): before an
        operator's re-run from scratch. The number of rows deleted."""
        with self.store.db.tx() as conn:
            return int(conn.execute(sql.clear_completed_steps(key)).rowcount or 0)

    def _params(
        self, key: str, generation: int, attempt_id: str, value: str, **extra: Any
    ) -> dict[str, Any]:
        return {
            "key": key,
            "generation": generation,
            "attempt_id": attempt_id,
            "value": value,
            "size": len(value.encode()),
            "now": self.store.db.stamp(utcnow()),
            **extra,
        }
