"""In-memory doubles of the two backends, for fast unit tests of the orchestration:
:class:`MemoryStore` (a :class:`~celery_fence.pipeline.ports.JobStore`, like
:class:`celery_fence.store.Store`) and :class:`MemoryLeaseStore` (a
:class:`~celery_fence.leases.ports.LeaseBackend`, like
:class:`celery_fence.leases.lease.LeaseStore`).

Pure Python, no I/O, thread-safe (one lock each). Each verb (each ending of
:meth:`MemoryStore.end`) is the real one's statement or Lua script, transcribed: the same
conditions, the same returned values, the same exceptions
(:class:`~celery_fence.errors.StaleGeneration` with the same ``context``,
:class:`~celery_fence.errors.LeaseBusy` with ``remaining``). Values are stored as JSON and read
back from it, as the database does. ``tests/integration/test_doubles_contract.py`` runs one set
of tests against these and the real ones (SQLite, PostgreSQL, Redis).

Not reproduced: the chaos harness's store without the fence, its outbox processing and operator
verbs (the staged effects of a completion are kept, see :meth:`MemoryStore.effects`), and what a
database refuses (PostgreSQL's jsonb refuses ``\\u0000``, which the real store then keeps
encoded; the double accepts it as is).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery_fence.actions import INTERRUPTED_BY, Action
from celery_fence.errors import JobDead, LeaseBusy, StaleGeneration
from celery_fence.leases.lease import DEFAULT_GENERATION_TTL, LeaseKeys, lease_keys
from celery_fence.schema import COMPLETED, DEAD, FAILED, PENDING, RETRYING, RUNNING, utcnow
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
    Transition,
    decode_request,
    dumps_strict,
    run_of,
)

__all__ = ["MemoryLeaseStore", "MemoryStore"]

#: The attempt id of a row no attempt has claimed (``celery_fence.store.sql.NEVER_CLAIMED``).
NEVER_CLAIMED = "-"


def _loads(text: str | None) -> Any:
    """A JSON parameter as the database stores it and reads it back."""
    return None if text is None else json.loads(text)


def _json(value: Mapping[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _reason(reason: str | None) -> str | None:
    """The transitions table keeps 255 characters of a reason, and no empty one."""
    return (reason or "")[:255] or None


class MemoryTransitions:
    """The transition reads of a :class:`MemoryStore` (``store.transitions``), as
    :class:`celery_fence.store.transitions.TransitionReads`."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def history(self, key: str) -> list[Transition]:
        with self.store._lock:
            return [t for t in self.store._transitions if t.key == key]

    def last_exit(self, key: str) -> str | None:
        """The action of the key's newest transition that is not a claim, a lease loss or the
        retry of an interrupted attempt. As in SQL, a ``retry_scheduled`` row without a reason
        is skipped too (``NOT (TRUE AND NULL LIKE ...)`` is NULL, not true)."""
        with self.store._lock:
            for t in reversed(self.store._transitions):
                if t.key != key or t.action in (Action.CLAIMED.value, Action.LOST.value):
                    continue
                if t.action == Action.RETRY_SCHEDULED.value and (
                    t.reason is None or t.reason.startswith(f"{INTERRUPTED_BY} ")
                ):
                    continue
                return t.action
        return None


class MemoryStore:
    """The fenced job store in a dict: the job verbs of :class:`celery_fence.store.Store`.

    ``record_transitions`` and ``error_message_length`` mean what the real store's settings of
    the same names mean. ``now``: the wall clock of its timestamps.
    """

    def __init__(
        self,
        *,
        record_transitions: bool = True,
        error_message_length: int = 500,
        now: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self.record_transitions = record_transitions
        self.error_message_length = error_message_length
        self._now = now
        self._lock = threading.RLock()
        self._jobs: dict[str, JobRecord] = {}
        self._transitions: list[Transition] = []
        self._effects: dict[str, Effect] = {}  # by idempotency key, in insertion order
        self._effect_keys: dict[str, str] = {}  # idempotency key -> job key
        self.transitions = MemoryTransitions(self)

    @staticmethod
    def _new_row(
        key: str, task_name: str, status: str, now: dt.datetime, **fields: Any
    ) -> JobRecord:
        """A new job row written at ``now``; ``fields`` set what differs from a never-claimed,
        unfinished row without result, request or error."""
        values: dict[str, Any] = {
            "generation": 0,
            "attempt_id": NEVER_CLAIMED,
            "attempts": 0,
            "result": None,
            "request": None,
            "error_type": None,
            "error_message": None,
            "finished_at": None,
            "retry_at": None,
        }
        values.update(fields)
        return JobRecord(
            key=key, task_name=task_name, status=status, created_at=now, updated_at=now, **values
        )

    # -- the fenced path ----------------------------------------------------------------------

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
        """Take the row for a strictly greater generation of a live job (``register_sql``),
        saying when the running row of another attempt it took over last moved."""
        text = request_json if request is None else _json(request)
        with self._lock:
            now = self._now()
            row = self._jobs.get(key)
            moved = None
            if row is not None and row.status == RUNNING and row.attempt_id != attempt_id:
                moved = row.updated_at if row.generation > 0 else None
            if row is None:
                row = self._new_row(
                    key,
                    task_name,
                    RUNNING,
                    now,
                    generation=generation,
                    attempt_id=attempt_id,
                    attempts=1,
                    request=_loads(text),
                )
            elif row.status not in (COMPLETED, DEAD) and row.generation < generation:
                row = dataclasses.replace(
                    row,
                    generation=generation,
                    attempt_id=attempt_id,
                    status=RUNNING,
                    attempts=1 if row.status == FAILED else row.attempts + 1,
                    updated_at=now,
                    retry_at=None,
                )
            else:
                stored = self._read(row)
                if row.status == COMPLETED:
                    return Registration("completed", row.attempts, row.generation, stored)
                if row.status == DEAD:
                    return Registration("dead", row.attempts, row.generation, stored)
                return Registration("stale", row.attempts, row.generation, stored)
            self._write(row, (Action.CLAIMED,), None, (), now)
            run = run_of(decode_request(row.request))
            return Registration(
                "registered", row.attempts, row.generation, run=run, took_over_from=moved
            )

    def end(self, key: str, ending: Ending) -> bool:
        """Apply ``ending`` (:meth:`celery_fence.store.Store.end`): each ending's statement,
        transcribed."""
        with self._lock:
            match ending:
                case Completion():
                    self._completion(key, ending)
                case RetryScheduled():
                    self._retry_scheduled(key, ending)
                case Dead():
                    self._dead(key, ending)
                case CallerFailed():
                    self._caller_failed(key, ending)
                case DeadRefused():
                    self._dead_refused(key, ending)
                case DeadUnregistered():
                    return self._dead_unregistered(key, ending)
                case DeadUnrun():
                    return self._dead_unrun(key, ending)
                case DeadStranded():
                    return self._dead_stranded(key, ending)
                case _:
                    raise TypeError(f"not an ending: {type(ending).__name__}")
            return True

    def _completion(self, key: str, e: Completion) -> None:
        """Result and ``completed`` where this attempt still owns a running row (``OWNED``)."""
        stored = _loads(dumps_strict(e.result, "task's return value"))
        row = self._owned(key, e.generation, e.attempt_id, "completion")
        now = self._now()
        row = dataclasses.replace(
            row,
            status=COMPLETED,
            result=stored,
            updated_at=now,
            finished_at=now,
            error_type=None,
            error_message=None,
        )
        self._write(row, (Action.COMPLETED,), None, e.effects, now)

    def _retry_scheduled(self, key: str, e: RetryScheduled) -> None:
        """``retrying`` until ``retry_at``, where this attempt owns the row."""
        row = self._owned(key, e.generation, e.attempt_id, "retry")
        now = self._now()
        row = dataclasses.replace(
            row, status=RETRYING, updated_at=now, retry_at=e.retry_at, **self._errors(e.error)
        )
        self._write(row, (Action.RETRY_SCHEDULED,), e.reason, (), now)

    def _caller_failed(self, key: str, e: CallerFailed) -> None:
        """``failed``, where this attempt owns the row."""
        row = self._owned(key, e.generation, e.attempt_id, "failure")
        now = self._now()
        row = dataclasses.replace(
            row,
            status=FAILED,
            updated_at=now,
            finished_at=now,
            retry_at=None,
            **self._errors(e.error),
        )
        self._write(row, (Action.FAILED,), e.reason, (), now)

    def _dead(self, key: str, e: Dead) -> None:
        """The terminal ``dead`` state, where this attempt owns the row (``attempts``: the count
        kept)."""
        row = self._owned(key, e.generation, e.attempt_id, "dead-letter")
        now = self._now()
        row = dataclasses.replace(
            row,
            status=DEAD,
            attempts=row.attempts if e.attempts is None else e.attempts,
            updated_at=now,
            finished_at=now,
            retry_at=None,
            **self._errors(e.error),
        )
        self._write(row, (Action.DEAD,), e.reason, (), now)

    def _dead_unregistered(
        self, key: str, e: DeadUnregistered, *, over_pending: bool = True
    ) -> bool:
        """A new ``dead`` row; an existing row only when it is ``pending`` (and
        ``over_pending``). True when the row was written."""
        now = self._now()
        row = self._jobs.get(key)
        if row is None:
            row = self._new_row(
                key,
                e.task_name,
                DEAD,
                now,
                request=_loads(_json(e.request)),
                finished_at=now,
                **self._errors(e.error, nulls=True),
            )
        elif row.status == PENDING and over_pending:
            row = dataclasses.replace(
                row,
                status=DEAD,
                updated_at=now,
                finished_at=now,
                **self._errors(e.error, nulls=True),
            )
        else:
            return False
        self._write(row, (Action.DEAD,), e.reason, (), now)
        return True

    def _dead_refused(self, key: str, e: DeadRefused) -> None:
        """``dead`` at once, fenced like a registration, the request kept encoded
        (``{"encoded": "..."}``)."""
        request = None if e.request_json is None else {ENCODED_REQUEST: e.request_json}
        now = self._now()
        row = self._jobs.get(key)
        errors = self._errors(e.error, nulls=True)
        if row is None:
            row = self._new_row(
                key,
                e.task_name,
                DEAD,
                now,
                generation=e.generation,
                attempt_id=e.attempt_id,
                attempts=1,
                request=_loads(_json(request)),
                finished_at=now,
                **errors,
            )
        elif row.status not in (COMPLETED, DEAD) and row.generation < e.generation:
            row = dataclasses.replace(
                row,
                task_name=e.task_name,
                status=DEAD,
                generation=e.generation,
                attempt_id=e.attempt_id,
                request=_loads(_json(request)),
                updated_at=now,
                finished_at=now,
                attempts=row.attempts + 1,
                **errors,
            )
        else:
            raise self._rejected(key, e.generation, e.attempt_id, "dead-letter")
        self._write(row, (Action.DEAD,), e.reason, (), now)

    def _dead_unrun(self, key: str, e: DeadUnrun) -> bool:
        """A new ``dead`` row, else the row that waits for this message goes ``dead``, else a
        transition only (False)."""
        reason = e.reason
        error = JobDead(f"the message was {reason} before it ran; requeue the job to run it")
        if e.terminated_id is not None:
            error = JobDead(f"the attempt was {reason} while it ran; requeue the job to run it")
        unregistered = DeadUnregistered(e.task_name, e.request, error, reason)
        if self._dead_unregistered(key, unregistered, over_pending=False):
            return True
        before = self._jobs.get(key)
        if before is not None and e.waits_for(self._read(before)):
            now = self._now()
            row = dataclasses.replace(
                before,
                status=DEAD,
                updated_at=now,
                finished_at=now,
                retry_at=None,
                **self._errors(error),
            )
            self._write(row, (Action.DEAD,), reason, (), now)
            return True
        note = (
            "message not run" if e.terminated_id is None else "attempt terminated, job left as is"
        )
        self.record(key, action=reason, reason=note)
        return False

    def _dead_stranded(self, key: str, e: DeadStranded) -> bool:
        """``dead`` by compare-and-set on the row as read (status, generation, attempt,
        ``updated_at``: ``UNCHANGED``); False when it moved meanwhile."""
        before, row = e.record, self._jobs.get(key)
        if before.key != key:
            raise ValueError(f"a stranded job's record of {before.key!r}, not {key!r}")
        if row is None or (row.status, row.generation, row.attempt_id, row.updated_at) != (
            before.status,
            before.generation,
            before.attempt_id,
            before.updated_at,
        ):
            return False
        now = self._now()
        row = dataclasses.replace(
            row,
            status=DEAD,
            updated_at=now,
            finished_at=now,
            retry_at=None,
            **self._errors(e.error),
        )
        self._write(row, (Action.DEAD,), e.reason, (), now)
        return True

    def record(
        self,
        key: str,
        *,
        action: Action | str,
        generation: int | None = None,
        attempt_id: str | None = None,
        reason: str | None = None,
    ) -> None:
        """A transition that is not a state change of the job (lease lost, stale, busy)."""
        if not self.record_transitions:
            return
        with self._lock:
            self._transitions.append(
                Transition(key, generation, attempt_id, str(action), _reason(reason), self._now())
            )

    def insert_pending(
        self,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any],
        due: dt.datetime | None = None,
    ) -> tuple[bool, JobRecord | None]:
        """An enqueued job, ``pending`` and never claimed (generation 0, attempt ``-``), unless
        the key has a job: ``(True, None)`` or ``(False, that job)``. The real store's
        :meth:`~celery_fence.store.pending.PendingRows.insert` without its ``conn`` (it writes
        in the caller's transaction; here there is none)."""
        with self._lock:
            existing = self._jobs.get(key)
            if existing is not None:
                return False, self._read(existing)
            now = self._now()
            self._jobs[key] = self._new_row(
                key,
                task_name,
                PENDING,
                now,
                request=_loads(_json(request)),
                retry_at=due,
            )
            return True, None

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: str) -> JobRecord | None:
        with self._lock:
            row = self._jobs.get(key)
            return None if row is None else self._read(row)

    def effects(self, key: str) -> list[Effect]:
        """The effects staged by ``key``'s completion (the outbox rows it wrote)."""
        with self._lock:
            return [e for ik, e in self._effects.items() if self._effect_keys[ik] == key]

    def list_jobs(self) -> list[JobRecord]:
        """Every job (a test's view; not the real store's filtered ``list_jobs``)."""
        with self._lock:
            return [self._read(row) for row in self._jobs.values()]

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _read(row: JobRecord) -> JobRecord:
        """The row as a read returns it: the stored request decoded (as sent)."""
        return dataclasses.replace(row, request=decode_request(row.request))

    def _owned(self, key: str, generation: int, attempt_id: str, what: str) -> JobRecord:
        """The row where this attempt owns a running row, else :class:`StaleGeneration`."""
        row = self._jobs.get(key)
        if (
            row is None
            or row.generation != generation
            or row.attempt_id != attempt_id
            or row.status != RUNNING
        ):
            raise self._rejected(key, generation, attempt_id, what)
        return row

    def _rejected(self, key: str, generation: int, attempt_id: str, what: str) -> StaleGeneration:
        record = self._jobs.get(key)
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

    def _errors(self, error: BaseException | None, *, nulls: bool = False) -> dict[str, Any]:
        """The error columns of ``error`` (none without one; ``nulls``: NULLs without one, as
        the statements that always set them do)."""
        if error is None:
            return {"error_type": None, "error_message": None} if nulls else {}
        message = str(error)
        if len(message) > self.error_message_length:
            message = message[: self.error_message_length - 1] + "…"
        return {
            "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error_message": message,
        }

    def _write(
        self,
        row: JobRecord,
        actions: tuple[Action, ...],
        reason: str | None,
        effects: Sequence[Effect],
        now: dt.datetime,
    ) -> None:
        """The row, its transition rows and its staged effects, at once (under the lock)."""
        self._jobs[row.key] = row
        if self.record_transitions:
            why = _reason(reason)
            for action in actions:
                self._transitions.append(
                    Transition(row.key, row.generation, row.attempt_id, action.value, why, now)
                )
        for e in effects:  # ON CONFLICT (idempotency_key) DO NOTHING
            if e.idempotency_key not in self._effects:
                payload = json.loads(json.dumps(e.payload, separators=(",", ":")))
                self._effects[e.idempotency_key] = Effect(e.name, payload, e.idempotency_key)
                self._effect_keys[e.idempotency_key] = row.key


class MemoryLeaseStore:
    """The Redis lease scripts on a dict: the operations of
    :class:`celery_fence.leases.lease.LeaseStore`.

    ``clock``: monotonic seconds, for the lease and counter expiries (inject a fake one to expire
    leases without sleeping). ``generation_ttl``: seconds a generation counter lives after its
    last claim (0: forever), as the real one's.
    """

    def __init__(
        self,
        *,
        prefix: str = "fence",
        generation_ttl: float = DEFAULT_GENERATION_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.generation_ttl_ms = round(generation_ttl * 1000)
        self._clock = clock
        self._lock = threading.Lock()
        #: Redis' keyspace: name -> (value, monotonic expiry or None)
        self._data: dict[str, tuple[str, float | None]] = {}

    # -- Redis commands, on the keyspace (called under the lock) ------------------------------

    def _get(self, name: str) -> str | None:
        entry = self._data.get(name)
        if entry is None:
            return None
        value, expires = entry
        if expires is not None and expires <= self._clock():
            del self._data[name]
            return None
        return value

    def _pttl(self, name: str) -> int:
        """Milliseconds left (-2: no key, -1: no expiry)."""
        if self._get(name) is None:
            return -2
        expires = self._data[name][1]
        if expires is None:
            return -1
        return max(0, round((expires - self._clock()) * 1000))

    def _set(self, name: str, value: str, px: int | None = None) -> None:
        self._data[name] = (value, None if px is None else self._clock() + px / 1000)

    def _pexpire(self, name: str, ms: int) -> None:
        value = self._get(name)
        if value is None:
            return
        if ms <= 0:
            del self._data[name]
        else:
            self._set(name, value, ms)

    def _incr(self, name: str) -> int:
        """INCR: the counter plus one, its expiry kept."""
        current = self._get(name)
        expires = None if current is None else self._data[name][1]
        value = int(current or 0) + 1
        self._data[name] = (str(value), expires)
        return value

    def _release(self, lease_key: str, expected: str) -> bool:
        """release.lua: compare-and-delete; ``"<token>:"`` matches any generation."""
        value = self._get(lease_key)
        if value is not None and (
            value == expected or (expected.endswith(":") and value.startswith(expected))
        ):
            del self._data[lease_key]
            return True
        return False

    def _renew(self, lease_key: str, value: str, ttl_ms: int) -> bool:
        """renew.lua: extend only a lease still holding ``value``."""
        if self._get(lease_key) == value:
            self._pexpire(lease_key, ttl_ms)
            return True
        return False

    # -- LeaseBackend -------------------------------------------------------------------------

    def keys_for(self, key: str) -> LeaseKeys:
        return lease_keys(self.prefix, key)

    def claim(
        self, key: str, token: str, ttl_ms: int, *, releases: Sequence[tuple[str, str]] = ()
    ) -> int:
        """claim.lua: the releases first, then the lease with a new generation, or
        :class:`LeaseBusy` (``remaining`` in seconds) when a live lease exists."""
        keys = self.keys_for(key)
        with self._lock:
            for lease_key, value in releases:
                self._release(lease_key, value)
            remaining_ms = self._pttl(keys.lease)
            if remaining_ms == -2:
                generation = self._incr(keys.generation)
                if self.generation_ttl_ms > 0:
                    self._pexpire(keys.generation, self.generation_ttl_ms)
                self._set(keys.lease, f"{token}:{generation}", ttl_ms)
                return generation
        remaining = ttl_ms / 1000 if remaining_ms < 0 else remaining_ms / 1000
        raise LeaseBusy(f"lease for {key!r} is held by another attempt", remaining=remaining)

    def raise_generation(self, key: str, floor: int) -> int:
        """raise_generation.lua: set-if-greater on the counter; its value after."""
        counter = self.keys_for(key).generation
        with self._lock:
            current = int(self._get(counter) or 0)
            if current < floor:
                ttl = self.generation_ttl_ms
                self._set(counter, str(floor), ttl if ttl > 0 else None)
                return floor
            return current

    def take_generation(self, key: str) -> int:
        """INCR without a lease (and the counter's expiry renewed)."""
        counter = self.keys_for(key).generation
        with self._lock:
            generation = self._incr(counter)
            if self.generation_ttl_ms > 0:
                self._pexpire(counter, self.generation_ttl_ms)
            return generation

    def release(self, lease_key: str, value: str) -> bool:
        with self._lock:
            return self._release(lease_key, value)

    def renew(self, lease_key: str, value: str, ttl_ms: int) -> bool:
        with self._lock:
            return self._renew(lease_key, value, ttl_ms)

    def batch(
        self,
        renewals: Sequence[tuple[str, str, int]],
        releases: Sequence[tuple[str, str]],
    ) -> tuple[list[bool], list[bool]]:
        with self._lock:
            renewed = [self._renew(k, v, ttl) for k, v, ttl in renewals]
            released = [self._release(k, v) for k, v in releases]
        return renewed, released

    def remaining(self, key: str) -> tuple[float | None, int | None]:
        """(seconds left on the live lease or None, the lease's generation or None)."""
        lease_key = self.keys_for(key).lease
        with self._lock:
            pttl = self._pttl(lease_key)
            value = self._get(lease_key)
        if value is None or pttl < 0:
            return None, None
        return pttl / 1000, int(value.rsplit(":", 1)[1])

    # -- a test's view ------------------------------------------------------------------------

    def get(self, name: str) -> str | None:
        """The value of a key (lease or counter), as ``GET`` would return it (None: absent)."""
        with self._lock:
            return self._get(name)

    def pttl(self, name: str) -> int:
        """``PTTL``: milliseconds left (-2: no key, -1: no expiry)."""
        with self._lock:
            return self._pttl(name)
