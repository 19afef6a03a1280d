"""``fence_chaos``: the failure windows, injected into the user's own task, and the check.

Two real workers of the user's app, A and B (each also on the test's queue, for the outbox's
deliver task), and the windows, each given a Celery signature of the user's task:

- ``pause``: A's body starts (claim and registration done), A is SIGSTOPped — the whole worker,
  so its lease stops renewing — a duplicate is sent to B, which takes over once the lease expires
  and finishes; A is resumed after at least 1.5 TTL and finishes its attempt.
- ``pause-inside-block`` (:data:`BLOCK_WINDOWS`: for a task that writes in a fenced block,
  ``fence.atomic()``, ``transaction()`` or ``session()``): as ``pause``, but A is stopped inside
  its outermost fenced block, after its writes and before its fenced commit (on SQLite, whose
  write lock A then holds, A is resumed after 1.5 TTL without waiting for B).
- ``pause-inside-step`` (:data:`STEP_WINDOWS`: for a task with fenced steps,
  ``self.fence.run_step()`` / ``step()``): as ``pause-inside-block``, but A is stopped inside its
  ``k``-th step (:meth:`FenceChaos.pause_inside_step`; ``inject`` pauses inside the first), after
  the step's body and before its row and fenced commit. B skips the steps A committed; A, resumed,
  commits nothing of that step and runs no later one.
- ``kill``: A's pool process is SIGKILLed after the completion committed and before the ack;
  Celery gives the message back and A runs it again.
- ``duplicate``: one message (one task id) delivered to A and B at once.
- ``redis-loss``: A's body is held while every lease and generation counter of the test is deleted
  from Redis; a duplicate runs on B (Redis hands out a generation the store already saw), then A's
  body goes on.
- ``kill-slot-holder`` (:data:`GROUP_WINDOWS`: for a task with ``fence_group`` and
  ``fence_group_limit``): A's body starts holding one of its group's slots and A's pool process
  is SIGKILLed there; the slot must be free again within one TTL of the kill (else
  :class:`ConvergenceError` at once; the seconds it took are the injection's ``slot_back_s``),
  and the message comes back and completes.

Then :meth:`FenceChaos.assert_converged` waits (bounded) for every delivery to finish and checks
the store and the callers: one completion, no stale write accepted, every caller got the stored
result, each outbox effect recorded once. A failure names the window and prints the key's
transition history and the bodies that ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery.canvas import Signature

from celery_fence.testing import faults, processes
from celery_fence.testing.environment import FenceEnv

WINDOWS = ("pause", "pause-at-write", "kill", "duplicate", "redis-loss")
#: Windows for a task with a fenced block (``fence.atomic()``, ``transaction()``, ``session()``):
#: not in :data:`WINDOWS`, whose windows fit every task.
BLOCK_WINDOWS = ("pause-inside-block", "kill-after-block")
#: Windows for a task with fenced steps (``self.fence.run_step()``, ``fence.step()``).
STEP_WINDOWS = ("pause-inside-step",)
#: Windows for a task of a concurrency group with a limit (``fence_group_limit``).
GROUP_WINDOWS = ("kill-slot-holder",)
#: Seconds beyond one TTL a killed holder's slot may take to be seen free (the polling).
SLOT_BACK_SLACK = 0.25
FINAL_STATES = ("SUCCESS", "FAILURE")
#: Seconds assert_converged waits for an ``unfenced_write`` row still being written.
UNFENCED_GRACE = 0.5


class ConvergenceError(AssertionError):
    """A window broke one of the properties :meth:`FenceChaos.assert_converged` checks."""


@dataclass
class Injection:
    """One window as it was run: which task ids were sent, and how many deliveries of each."""

    window: str
    task: str
    started: float = field(default_factory=time.time)
    deliveries: dict[str, int] = field(default_factory=dict)
    #: ``kill-slot-holder``: seconds from the SIGKILL until the killed attempt's slot was free.
    slot_back_s: float | None = None


class FenceChaos:
    """The ``fence_chaos`` fixture. ``inject(window, signature)`` (or ``pause(signature)``,
    ``kill``, ``duplicate``, ``redis_loss``), then ``assert_converged(key)`` with the logical key
    the signature's ``fence_key`` gives; parametrize a test over :data:`WINDOWS` to run them all.
    """

    windows = WINDOWS
    block_windows = BLOCK_WINDOWS
    step_windows = STEP_WINDOWS
    group_windows = GROUP_WINDOWS

    def __init__(self, env: FenceEnv, *, timeout: float = 60.0) -> None:
        self.env = env
        self.timeout = timeout
        self.injections: list[Injection] = []
        self._checked = 0
        self._workers: tuple[processes.Worker, processes.Worker] | None = None

    # -- the workers -----------------------------------------------------------------------------

    @property
    def workers(self) -> tuple[processes.Worker, processes.Worker]:
        """Workers A and B, started on first use (each ``-c 1``)."""
        if self._workers is None:
            q = self.env.queue
            a = self.env.worker("a", queues=[f"{q}.a", q])
            b = self.env.worker("b", queues=[f"{q}.b", q])
            self._workers = (a.launch(), b.launch())  # stopped by FenceEnv.close, whatever happens
            a.wait_ready()
            b.wait_ready()
        return self._workers

    # -- the windows -----------------------------------------------------------------------------

    def inject(self, window: str, signature: Signature) -> Injection:
        """Run one window (see :data:`WINDOWS`) against ``signature``."""
        runs: dict[str, Callable[[Signature], Injection]] = {
            "pause": self.pause,
            "pause-inside-block": self.pause_inside_block,
            "pause-inside-step": self.pause_inside_step,
            "pause-at-write": self.pause_at_write,
            "kill-after-block": self.kill_after_block,
            "kill": self.kill,
            "duplicate": self.duplicate,
            "redis-loss": self.redis_loss,
            "kill-slot-holder": self.kill_slot_holder,
        }
        if window not in runs:
            known = ", ".join(WINDOWS + BLOCK_WINDOWS + STEP_WINDOWS + GROUP_WINDOWS)
            raise ValueError(f"unknown window {window!r}: choose from {known}")
        return runs[window](signature)

    def pause(self, signature: Signature) -> Injection:
        """Pause A after its claim for longer than the TTL while a duplicate runs on B."""
        a, b = self.workers
        inj = self._begin("pause", signature)
        first = self._send(inj, signature, a, fault=("start", "hold"))
        self._wait_event(inj, "start", first, "the body to start on worker A")
        a.pause()
        paused_at = time.monotonic()
        try:
            self._release(first)  # A goes on from here once it is resumed
            second = self._send(inj, signature, b)
            self._wait(lambda: self._finished(second) >= 1, "the duplicate to finish on worker B")
            time.sleep(max(0.0, self.env.lease_ttl * 1.5 - (time.monotonic() - paused_at)))
        finally:
            a.resume()
        return inj

    def pause_inside_block(self, signature: Signature) -> Injection:
        """Pause A inside its fenced block (writes made, commit not) for longer than the TTL
        while a duplicate runs on B."""
        return self._pause_at(
            "pause-inside-block",
            "block",
            signature,
            what="the body to reach its fenced commit on worker A",
            missing="finished without a fenced block to pause inside: the pause-inside-block "
            "window needs a body that writes in a fenced block (self.fence.atomic(), "
            "transaction() or session())",
        )

    def pause_inside_step(self, signature: Signature, step: int = 1) -> Injection:
        """Pause A inside the ``step``-th fenced step its body runs (1, 2, ...: the step's body
        run, its row and commit not) for longer than the TTL while a duplicate runs on B."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"pause_inside_step(step={step!r}): the step's ordinal, 1 or more")
        return self._pause_at(
            "pause-inside-step",
            "step",
            signature,
            what=f"the body to reach the end of its fenced step {step} on worker A",
            missing=f"finished without a fenced step {step} to pause inside: the "
            "pause-inside-step window needs a body that runs that many fenced steps "
            "(self.fence.run_step() or self.fence.step())",
            action=f"hold:{step}",
        )

    def pause_at_write(self, signature: Signature) -> Injection:
        """Pause A between a check and a write: at its body's first statement outside a fenced
        block, or right after its first ``fence.check()`` / ``guard()`` returns (outside a
        block), whichever comes first, for longer than the TTL while a duplicate runs on B. A
        body that checks, then writes outside a fenced block, lands a stale write here. A body
        with neither (it writes only in fenced blocks and never checks) is paused at its start,
        as ``pause``."""
        return self._pause_at(
            "pause-at-write",
            "write",
            signature,
            what="the body's first write or check outside a fenced block on worker A",
            missing=None,
        )

    def _pause_at(
        self,
        window: str,
        point: str,
        signature: Signature,
        *,
        what: str,
        missing: str | None,
        action: str = "hold",
    ) -> Injection:
        a, b = self.workers
        inj = self._begin(window, signature)
        first = self._send(inj, signature, a, fault=(point, action))
        self._wait(
            lambda: self._seen(point, first) or self._finished(first) >= 1,
            f"{what} (window {window!r})",
        )
        if not self._seen(point, first):
            if missing is not None:
                raise ConvergenceError(f"fence_chaos: task {inj.task} {missing}")
            # Nothing to pause at before the body returned: run the window as ``pause``.
            self.injections.remove(inj)
            inj = self.pause(signature)
            inj.window = window
            return inj
        a.pause()
        paused_at = time.monotonic()
        holds_the_database = self.env.store.dialect == "sqlite"
        try:
            self._release(first)  # A goes on from the paused point once it is resumed
            second = self._send(inj, signature, b)
            if holds_the_database:  # nothing ends a stopped SQLite writer's transaction
                time.sleep(max(0.0, self.env.lease_ttl * 1.5 - (time.monotonic() - paused_at)))
                a.resume()
            self._wait(lambda: self._finished(second) >= 1, "the duplicate to finish on worker B")
            time.sleep(max(0.0, self.env.lease_ttl * 1.5 - (time.monotonic() - paused_at)))
        finally:
            a.resume()
        return inj

    def kill_after_block(self, signature: Signature) -> Injection:
        """Let A's outermost fenced block commit, then SIGKILL A's pool process before its
        completion: the message comes back once A's lease expired, and the body runs again
        (on A or B). A body that appends rows in its block, instead of writing them keyed by
        the job, leaves them twice: ``check=`` sees it."""
        a, _ = self.workers
        inj = self._begin("kill-after-block", signature)
        tid = self._send(inj, signature, a, fault=("after_block", "kill"))
        self._wait(
            lambda: self._seen("kill", tid) or self._finished(tid) >= 1,
            "the fenced block to commit (and the kill) on worker A (window 'kill-after-block')",
        )
        if not self._seen("kill", tid):
            raise ConvergenceError(
                f"fence_chaos: task {inj.task} finished without a fenced block that committed: "
                "the kill-after-block window needs a body that writes in a fenced block "
                "(self.fence.atomic(), transaction() or session())"
            )
        return inj

    def kill(self, signature: Signature) -> Injection:
        """SIGKILL A's pool process after the completion commits and before the ack."""
        a, _ = self.workers
        inj = self._begin("kill", signature)
        tid = self._send(inj, signature, a, fault=("commit", "kill"))
        self._wait_event(inj, "kill", tid, "the completion (and the kill) on worker A")
        return inj

    def duplicate(self, signature: Signature) -> Injection:
        """Deliver one message (the same task id) to A and B at once."""
        a, b = self.workers
        inj = self._begin("duplicate", signature)
        tid = self._send(inj, signature, a)
        self._send(inj, signature, b, task_id=tid)
        return inj

    def redis_loss(self, signature: Signature) -> Injection:
        """Lose every lease and generation counter while A's body runs; a duplicate runs on B."""
        a, b = self.workers
        inj = self._begin("redis-loss", signature)
        first = self._send(inj, signature, a, fault=("start", "hold"))
        try:
            self._wait_event(inj, "start", first, "the body to start on worker A")
            self._lose_counters()
            second = self._send(inj, signature, b)
            self._wait(lambda: self._finished(second) >= 1, "the duplicate to finish on worker B")
        finally:
            self._release(first)
        return inj

    def kill_slot_holder(self, signature: Signature) -> Injection:
        """SIGKILL A's pool process while its body runs holding a slot of the task's group
        (``fence_group_limit``): the slot must be free again within one TTL of the kill (its
        lease is no longer renewed), and the message comes back and completes."""
        a, _ = self.workers
        inj = self._begin("kill-slot-holder", signature)
        tid = self._send(inj, signature, a, fault=("start", "hold"))
        self._wait_event(inj, "start", tid, "the body to start on worker A")
        start = next(e for e in self._all_events() if e["ev"] == "start" and e.get("tid") == tid)
        slot = self._slot_of(str(start.get("attempt")))
        if slot is None:
            self._release(tid)
            raise ConvergenceError(
                f"fence_chaos: task {inj.task} ran holding no group slot: the kill-slot-holder "
                "window needs a task with fence_group and fence_group_limit"
            )
        slot_key, value = slot
        client, ttl = self.env.redis.client, self.env.lease_ttl
        os.kill(int(start["pid"]), signal.SIGKILL)
        killed = time.monotonic()
        processes.poll_until(lambda: client.get(slot_key) != value, ttl * 4, interval=0.01)
        inj.slot_back_s = time.monotonic() - killed
        if inj.slot_back_s > ttl + SLOT_BACK_SLACK:
            raise ConvergenceError(
                f"fence_chaos: window 'kill-slot-holder': the killed attempt's slot of task "
                f"{inj.task} was still held {inj.slot_back_s:.2f}s after the SIGKILL (one TTL is "
                f"{ttl:g}s): a slot must die with its worker"
            )
        return inj

    def _slot_of(self, attempt: str) -> tuple[Any, Any] | None:
        """The group slot (its key and value) the attempt ``attempt`` holds, if any."""
        client = self.env.redis.client
        for key in client.scan_iter(f"{self.env.prefix}:*:slot:*", count=1000):
            value: Any = client.get(key)
            if value is not None and bytes(value).decode().startswith(f"{attempt}/slot:"):
                return key, value
        return None

    # -- the check -------------------------------------------------------------------------------

    def assert_converged(
        self,
        key: str,
        *,
        timeout: float | None = None,
        check: Callable[[Any], Any] | None = None,
    ) -> None:
        """Check every window injected since the last call against logical key ``key``.

        Waits (at most ``timeout`` seconds) until every delivery finished and the job is
        terminal, then requires: exactly one completion, none of them from a generation older
        than one that had claimed the key, every caller's result equal to the stored one, and
        each outbox effect recorded once (the effects the completing attempt staged).

        ``check``: your own rows too — called with the stored job (a
        :class:`~celery_fence.store.JobRecord`: ``generation``, ``attempt_id``, ``result``) once
        the job converged; a falsy return or an ``AssertionError`` fails the assertion.
        """
        pending = self.injections[self._checked :]
        self._checked = len(self.injections)
        if not pending:
            raise ConvergenceError("fence_chaos.assert_converged: inject a window first")
        for inj in pending:
            problems = self._problems(inj, key, self.timeout if timeout is None else timeout)
            record = self.env.store.get(key)
            if check is not None and record is not None and _settled(problems):
                problems += _user_check(check, record)
            if problems:
                raise ConvergenceError(self._report(inj, key, problems))

    def _problems(self, inj: Injection, key: str, timeout: float) -> list[str]:
        store = self.env.store

        def settled() -> bool:
            if any(self._finished(t) < n for t, n in inj.deliveries.items()):
                return False
            record = store.get(key)
            return record is None or record.status in ("completed", "dead")

        if not processes.poll_until(settled, timeout, interval=0.1):
            unfinished = [t for t, n in inj.deliveries.items() if self._finished(t) < n]
            record = store.get(key)
            status = record.status if record else "not in the store"
            return [
                f"did not converge within {timeout:g}s: job {status}, "
                f"{len(unfinished)} of {len(inj.deliveries)} messages not finished "
                f"({', '.join(t[:8] for t in unfinished) or '-'})"
            ]
        record = store.get(key)
        if record is None:
            ran = sorted({str(e.get("key")) for e in self._events(inj) if e["ev"] == "start"})
            return [
                f"no job {key!r} in the fence store: is the task a FencedTask whose fence_key "
                f"gives this key? (its bodies ran under key {', '.join(ran) or '-'})"
            ]
        problems: list[str] = []
        if record.status != "completed":
            problems.append(
                f"the job ended {record.status} ({record.error_type or 'no error'}), not completed"
            )
        history = store.transitions.history(key)
        completions = [t for t in history if t.action == "completed"]
        if len(completions) != 1:
            gens = ", ".join(f"generation {t.generation}" for t in completions) or "none"
            problems.append(f"{len(completions)} completions recorded ({gens}); expected exactly 1")
        for i, done in enumerate(completions):
            index = history.index(done)
            newer = [
                t.generation or 0
                for t in history[:index]
                if t.action == "claimed" and (t.generation or 0) > (done.generation or 0)
            ]
            if newer:
                problems.append(
                    f"a stale write was accepted: generation {done.generation} completed after "
                    f"generation {max(newer)} had claimed the key"
                )
            if i == len(completions) - 1 and (done.generation, done.attempt_id) != (
                record.generation,
                record.attempt_id,
            ):
                problems.append(
                    f"the stored job (generation {record.generation}) is not the one the last "
                    f"completion wrote (generation {done.generation})"
                )
        unfenced = _unfenced_writes(history)
        if not unfenced:  # the row is written off the body's thread: give it a moment
            time.sleep(UNFENCED_GRACE)
            history = store.transitions.history(key)
            unfenced = _unfenced_writes(history)
        problems += unfenced
        problems += self._caller_problems(inj, record.result)
        problems += self._outbox_problems(inj, key, record.attempt_id)
        problems += self._block_problems(inj)
        return problems

    def _caller_problems(self, inj: Injection, stored: Any) -> list[str]:
        problems = []
        for tid in inj.deliveries:
            result = self.env.app.AsyncResult(tid)
            value = result.get(timeout=10, propagate=False)
            state = result.state
            if state != "SUCCESS":
                problems.append(
                    f"the caller of task {tid[:8]} got {state} ({type(value).__name__})"
                )
            elif _canonical(value) != _canonical(stored):
                problems.append(
                    f"the caller of task {tid[:8]} got a result that is not the stored one "
                    f"(sha256 {_digest(value)} != stored {_digest(stored)})"
                )
        return problems

    def _outbox_problems(self, inj: Injection, key: str, attempt_id: str) -> list[str]:
        rows = self.env.store.outbox_rows.rows(key=key)
        names = Counter(r.name for r in rows)
        problems = [
            f"outbox effect {name!r} recorded {count} times" for name, count in names.items()
        ]
        problems = [p for p in problems if not p.endswith(" 1 times")]
        staged = [
            e.get("staged") or []
            for e in self._events(inj)
            if e["ev"] == "return" and e.get("attempt") == attempt_id
        ]
        if staged and sorted(staged[-1]) != sorted(names):
            problems.append(
                f"outbox rows {sorted(names)} are not the effects the completing attempt staged "
                f"({sorted(staged[-1])})"
            )
        return problems

    def _block_problems(self, inj: Injection) -> list[str]:
        """The fenced blocks' own rows: no ``fence.transaction()`` / ``session()`` block of a
        generation committed after a newer generation's body had started (its registration
        came first, so the block's commit had to be refused)."""
        events = self._events(inj)
        starts = [
            (int(e["gen"]), float(e["t"])) for e in events if e["ev"] == "start" and e.get("gen")
        ]
        problems = []
        for e in self._all_events():
            if e["ev"] != "block_committed" or e.get("attempt") not in self._attempts(events):
                continue
            newer = [g for g, t in starts if g > int(e["gen"]) and t < float(e["t0"])]
            if newer:
                problems.append(
                    f"a fenced block of generation {e['gen']} committed its rows although "
                    f"generation {max(newer)} had registered and started before that commit"
                )
        return problems

    @staticmethod
    def _attempts(events: list[dict[str, Any]]) -> set[str]:
        return {str(e["attempt"]) for e in events if e["ev"] == "start" and e.get("attempt")}

    def _report(self, inj: Injection, key: str, problems: list[str]) -> str:
        lines = [f"fence_chaos: window {inj.window!r} broke for key {key!r} (task {inj.task}):"]
        lines += [f"  - {p}" for p in problems]
        lines.append(f"transition history of {key!r}:")
        history = self.env.store.transitions.history(key)
        for t in history:
            lines.append(
                f"  {t.at:%H:%M:%S.%f}"[:-3]
                + f"  {t.action:<16} generation {t.generation!s:<4} "
                f"attempt {(t.attempt_id or '-')[:12]:<12}  {t.reason or ''}".rstrip()
            )
        if not history:
            lines.append("  (none)")
        lines.append("task bodies and deliveries seen by the workers:")
        for e in self._events(inj):
            what = f"  +{e['t'] - inj.started:6.2f}s  {e['ev']:<8} task {str(e.get('tid'))[:8]}"
            if e["ev"] in ("start", "return", "released"):
                what += f"  pid {e['pid']}  generation {e.get('gen')}"
                what += f"  attempt {str(e.get('attempt'))[:12]}"
            elif e["ev"] == "done":
                what += f"  {e.get('state')}"
            lines.append(what)
        return "\n".join(lines)

    # -- plumbing --------------------------------------------------------------------------------

    def _begin(self, window: str, signature: Signature) -> Injection:
        if not isinstance(signature, Signature):
            raise TypeError(f"give a signature, e.g. my_task.s(42), not {signature!r}")
        inj = Injection(window=window, task=str(signature.task))
        self.injections.append(inj)
        return inj

    def _send(
        self,
        inj: Injection,
        signature: Signature,
        worker: processes.Worker,
        *,
        fault: tuple[str, str] | None = None,
        task_id: str | None = None,
    ) -> str:
        tid = task_id or uuid.uuid4().hex
        if fault is not None:
            point, action = fault
            client, base = self.env.redis.client, self.env.ledger_base
            faults.arm(client, base, faults.FAULT_POINT, point, tid, value=action, ttl=600)
        self.env.app.send_task(
            str(signature.task),
            args=tuple(signature.args),
            kwargs=dict(signature.kwargs),
            task_id=tid,
            queue=worker.queue,
        )
        inj.deliveries[tid] = inj.deliveries.get(tid, 0) + 1
        return tid

    def _release(self, tid: str) -> None:
        self.env.redis.client.rpush(f"{self.env.ledger_base}:release:{tid}", 1)

    def _lose_counters(self) -> None:
        """Delete every lease and generation counter of the test (what a Redis restart loses)."""
        client, prefix = self.env.redis.client, self.env.prefix
        keep = (f"{prefix}:testing:", f"{prefix}:results:", f"{prefix}:broker:")
        keys = [
            k
            for k in client.scan_iter(f"{prefix}:*", count=1000)
            if not k.decode().startswith(keep)
        ]
        if keys:
            client.delete(*keys)

    def _all_events(self) -> list[dict[str, Any]]:
        raw = self.env.redis.client.lrange(f"{self.env.ledger_base}:events", 0, -1)
        return [json.loads(r) for r in raw]

    def _events(self, inj: Injection) -> list[dict[str, Any]]:
        return [e for e in self._all_events() if e.get("tid") in inj.deliveries]

    def _finished(self, tid: str) -> int:
        return sum(
            1
            for e in self._all_events()
            if e["ev"] == "done" and e.get("tid") == tid and e.get("state") in FINAL_STATES
        )

    def _wait(self, predicate: Callable[[], Any], what: str) -> None:
        if not processes.poll_until(predicate, self.timeout, interval=0.05):
            raise ConvergenceError(
                f"fence_chaos: timed out after {self.timeout:g}s waiting for {what}"
            )

    def _seen(self, ev: str, tid: str) -> bool:
        return any(e["ev"] == ev and e.get("tid") == tid for e in self._all_events())

    def _wait_event(self, inj: Injection, ev: str, tid: str, what: str) -> None:
        self._wait(lambda: self._seen(ev, tid), f"{what} (window {inj.window!r})")


def _settled(problems: list[str]) -> bool:
    """The job converged (whatever else went wrong): the user's check can read its rows."""
    return not any(p.startswith(("did not converge", "no job ")) for p in problems)


def _unfenced_writes(history: list[Any]) -> list[str]:
    """The writes the key's attempts made outside any fenced block (their ``unfenced_write``
    transitions, recorded whatever ``fence_unfenced_writes`` says unless it is ``"allow"``)."""
    return [
        f"generation {t.generation} wrote outside a fenced block ({t.reason or 'no detail'}): "
        "a stale attempt's write there lands; write in self.fence.transaction()/session()/"
        "atomic(), or stage it on self.fence.effects"
        for t in history
        if t.action == "unfenced_write"
    ]


def _user_check(check: Callable[[Any], Any], record: Any) -> list[str]:
    name = getattr(check, "__name__", repr(check))
    try:
        ok = check(record)
    except AssertionError as exc:
        return [f"your check {name} failed on the converged job: {exc or 'AssertionError'}"]
    if not ok:
        return [
            f"your check {name} returned {ok!r} on the converged job (generation "
            f"{record.generation}, attempt {record.attempt_id})"
        ]
    return []


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()[:10]
