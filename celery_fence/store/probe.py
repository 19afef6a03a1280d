"""The store's self-test (``celery fence check``): the writes and reads of a fenced task, on a
probe key, through the same code a task runs, in one transaction that is rolled back.

A store that can be connected to and whose tables exist can still refuse a task's writes: a
read-only role or standby, missing privileges, a driver that cannot run the statements. The probe
finds those before a worker does. Each step that does not do what it must raises
:class:`~celery_fence.errors.StoreError` naming the step; a database error comes out as it is
(``StoreError`` names the step and chains it). Nothing is left behind: the transaction is rolled
back and its connection closed, whatever happens.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from celery_fence.errors import StaleGeneration, StoreError
from celery_fence.schema import COMPLETED, utcnow
from celery_fence.store.driver_errors import driver_error_line
from celery_fence.store.records import Completion, Effect, RetryScheduled

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store

#: Probe keys start with this (none is ever committed).
PROBE_KEY_PREFIX = "celery-fence-check:"
_TASK = "celery_fence.check"


def write_probe(store: Store) -> str:
    """Run a fenced task's statements on a probe key and roll them back: register, schedule a
    retry, register the next generation, the fenced commit check (and, fenced, its refusal of the
    older generation), complete with a staged outbox row, read it all back. Returns what it ran."""
    key = f"{PROBE_KEY_PREFIX}{uuid.uuid4().hex}"
    with _step_named("transaction"), store.db.rolled_back() as db:
        _steps(store.on(db), key)
    with _step_named("read after the rollback"):
        left = store.get(key)
    if left is not None:  # the rollback left nothing: a write outside it would show
        raise StoreError(f"the probe job {key!r} outlived its rolled-back transaction")
    ran = "registered, retried, re-registered, commit-checked, completed with an outbox row"
    return f"{ran} and read back a probe job, rolled back"


@contextmanager
def _step_named(what: str) -> Iterator[None]:
    """A failure inside as :class:`StoreError` naming ``what`` and the error's class and first
    line (the database error chained); a ``StoreError`` of a step passes as it is."""
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"the probe's {what} failed: {driver_error_line(exc)}") from exc


def _step(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    with _step_named(what):
        return fn(*args, **kwargs)


def _steps(store: Store, key: str) -> None:
    later = utcnow() + dt.timedelta(hours=1)
    first = _step(
        "registration", store.register, key, generation=1, attempt_id="a1", task_name=_TASK
    )
    _expect(first.outcome == "registered", "registration", f"outcome {first.outcome}")
    retry = RetryScheduled(1, "a1", RuntimeError("probe"), later, "probe")
    _step("retry", store.end, key, retry)
    second = _step(
        "registration", store.register, key, generation=2, attempt_id="a2", task_name=_TASK
    )
    _expect(second.attempts == 2, "second registration", f"{second.attempts} attempts, not 2")
    with store.db.connect() as conn:
        owner = _step(
            "commit check", store.blocks.commit_check, conn, key, generation=2, attempt_id="a2"
        )
        _expect(owner, "commit check", "the owner's check found no row")
        stale = _step(
            "commit check", store.blocks.commit_check, conn, key, generation=1, attempt_id="a1"
        )
        _expect(not stale, "commit check", "an older generation passed it")
    try:
        _step("stale completion", store.end, key, Completion(1, "a1", "stale"))
    except StaleGeneration:
        pass
    else:
        raise StoreError("the probe's stale completion was accepted: the fence is off")
    effect = Effect(name="probe", payload={"probe": True}, idempotency_key=f"{key}:probe")
    _step("completion", store.end, key, Completion(2, "a2", {"probe": 2}, [effect]))
    record = _step("read", store.get, key)
    _expect(record is not None, "read", "no row")
    got = (record.status, record.generation, record.result)
    _expect(got == (COMPLETED, 2, {"probe": 2}), "read", f"status, generation, result {got}")
    rows = _step("outbox read", store.outbox_rows.rows, key=key)
    _expect([r.payload for r in rows] == [{"probe": True}], "outbox read", f"{len(rows)} rows")
    if store.record_transitions:
        actions = [t.action for t in _step("history read", store.transitions.history, key)]
        want = ["claimed", "retry_scheduled", "claimed", "completed"]
        _expect(actions == want, "history read", f"transitions {actions}")


def _expect(ok: Any, step: str, detail: str) -> None:
    if not ok:
        raise StoreError(f"the probe's {step} did not do what a task needs: {detail}")
