"""Stranded jobs: found, and re-sent under their own key, with their workflow.

A job row can stay ``running``, ``retrying`` or ``pending`` with no message left to finish it: a
purged queue, a broker that lost messages, a ``fence requeue`` that died between its commit and
its send, a worker killed while the Redis broker's visibility timeout is still hours away.
Such a row is **stranded** when no live lease holds its key in Redis and — for a ``retrying``
job, or a ``pending`` one recovery sent — it has not moved for ``fence_recover_after`` seconds
(default: 3 x ``fence_lease_ttl``; for a ``retrying`` job, counted from its ``retry_at`` too). A
``running`` job needs no quiet time: its attempt renews its lease every fraction of the TTL, so
the lease's absence is the signal (the row is read before the lease, and a claim takes its lease
before it registers: a job just claimed is never taken). A job :func:`~celery_fence.enqueue`
wrote and no attempt has claimed (``pending``, generation 0) has no attempt to wait out: its
threshold is the shorter ``fence_recover_pending_after`` (counted from its countdown or eta,
if it has one). One whose message is still waiting in a long broker backlog is then sent twice;
the claim fences both copies on the key, so it completes once. Each job is judged with its own
task's settings (:class:`~celery_fence.ops.scope.Scope`): its lease is looked up under its task's
Redis and key prefix, its threshold is its task's ``fence_recover_after``, and every database the
app's fenced tasks write to is scanned.

:func:`recover` re-sends each stranded job from its stored request: task, args, kwargs, the
exchange and routing key it was delivered with, and what Celery needs to carry its workflow on
(chain, link/link_error callbacks, chord, group, root and parent ids, time limits, custom
headers; how it was published: ``ignore_result``, ``serializer``, ``compression``,
``delivery_mode``; for a job :func:`~celery_fence.enqueue` wrote, also its ``eta``, ``retry``
and ``retry_policy``: :data:`celery_fence.store.records.EXECUTION_OPTIONS`), under the same key.
Before the send, the row is moved to ``pending`` by a compare-and-set on what was observed (status,
generation, attempt, ``updated_at``), so two recoveries running at once send it once. The re-sent
message goes through the ordinary claim: if the original message was only late and turns up too,
both are fenced on the key and one completion is stored. A job that ended ``dead`` (also a
revoked one) is never stranded.

Every fenced worker runs it itself, every ``fence_recover_interval`` seconds
(:mod:`celery_fence.ops.recovery_thread`). Three more ways to run it: ``celery -A proj fence recover
[--older-than S] [--dry-run]``, the task
:data:`RECOVER_TASK` in beat (registered by :func:`celery_fence.install` on each app that has a
fenced task, or that you install yourself)::

    beat_schedule = {"fence-recover": {"task": "celery_fence.recover", "schedule": 60.0}}

or :func:`recover` from your own code. ``fence ls --stuck`` lists the same set. The app must know
its fenced tasks (the CLI imports the app's task modules, a worker has them): a job whose task
the app lacks is judged with the app's settings.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_fence.actions import Action, LogAction
from celery_fence.announce.transitions import emit_transition
from celery_fence.errors import FenceError
from celery_fence.ops.scope import Scope
from celery_fence.schema import PENDING, RUNNING, utcnow
from celery_fence.store import UNFINISHED, JobRecord, Store
from celery_fence.store.records import (
    ENQUEUED_HEADER,
    EXECUTION_OPTIONS,
    TAKEOVER_HEADER,
    DeadStranded,
)

logger = logging.getLogger("celery_fence.recovery")

#: The beat task: ``{"task": RECOVER_TASK, "schedule": 60.0}``.
RECOVER_TASK = "celery_fence.recover"
#: Stranded jobs one run looks at, at most (the next run takes the rest).
DEFAULT_LIMIT = 1000
#: The message header that names the job's key on a re-send (see :func:`send_stored`).
KEY_HEADER = "fence_key"
#: Celery task ids longer than this are not sent as they are (AMQP's correlation id is a
#: short string of at most 255 bytes).
MAX_TASK_ID = 255
UNKEYED_PREFIX = "unkeyed:"


class NotResendable(FenceError):
    """The job cannot be re-sent: it has no stored request (its arguments or workflow were not
    JSON)."""


@dataclass
class RecoveryReport:
    """What one :func:`recover` run found and did (keys only, never payloads)."""

    stranded: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    raced: list[str] = field(default_factory=list)  # another recovery or an attempt moved it
    dead: list[str] = field(default_factory=list)  # no stored request: moved to dead
    failed: list[str] = field(default_factory=list)  # the send failed (retried next run)
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "stranded": len(self.stranded),
            "sent": len(self.sent),
            "raced": len(self.raced),
            "dead": len(self.dead),
            "failed": len(self.failed),
            "dry_run": self.dry_run,
        }


def stranded_jobs(
    scope: Scope,
    *,
    older_than: float | None = None,
    limit: int = DEFAULT_LIMIT,
    task_name: str | None = None,
    resend_backoff: bool = True,
    statuses: Sequence[str] = UNFINISHED,
    where: Callable[[JobRecord], bool] | None = None,
) -> list[tuple[Store, JobRecord]]:
    """Unfinished jobs, in every database of the app's fenced tasks, that have not moved for
    ``older_than`` seconds (None: each for its own task's ``fence_recover_after``) and whose
    lease is gone from their own task's Redis and prefix; oldest first within a database, at
    most ``limit``. ``resend_backoff``: leave out a job whose last re-send is not yet due again
    (:func:`_resends_due`); listing (``fence ls --stuck``) shows every stranded job.
    ``statuses`` and ``where`` narrow the jobs looked for (``ls --stuck --status``,
    ``--never-claimed``).

    The scan pages through each database's candidates, oldest first, until ``limit`` jobs are
    found or none is left: however many older jobs are not stranded (held by a live lease,
    judged by a longer threshold, or a re-send not yet due), none of them hides one that is. A
    page costs one statement, one round trip per lease Redis for its leases, and one statement
    for its ``pending`` jobs' re-sends."""
    found: list[tuple[Store, JobRecord]] = []
    floor = scope.min_threshold(older_than)
    now = utcnow()
    for database in scope.databases():
        after: tuple[dt.datetime, str] | None = None
        while len(found) < limit:
            page = database.store.admin.stranded(
                older_than=floor,
                running_older_than=0.0 if older_than is None else older_than,
                limit=limit,
                task_name=task_name,
                now=now,
                statuses=statuses,
                after=after,
            )
            quiet = [
                r for r in page if (where is None or where(r)) and scope.quiet_enough(r, older_than)
            ]
            held = scope.held(quiet)
            free = [r for r in quiet if r.key not in held]
            if resend_backoff:
                free = _resends_due(scope, database.store, free, older_than)
            found += [(database.store, record) for record in free]
            if len(page) < limit:
                break
            after = (page[-1].updated_at, page[-1].key)
    return found[:limit]


#: A job recovery re-sent that nobody claimed since waits 2, 4, 8, 16 thresholds (at most)
#: before its next re-send: its message may only be waiting in a long queue.
MAX_RESEND_DOUBLINGS = 4


def _resends_due(
    scope: Scope, store: Store, records: Sequence[JobRecord], older_than: float | None
) -> list[JobRecord]:
    """The stranded jobs due for a re-send: every one but a ``pending`` job whose n-th re-send in
    a row nobody claimed is younger than 2**n thresholds (n at most
    :data:`MAX_RESEND_DOUBLINGS`). One statement for the page's ``pending`` jobs."""
    unclaimed = store.admin.resends_unclaimed([r.key for r in records if r.status == PENDING])

    def due(record: JobRecord) -> bool:
        count = unclaimed.get(record.key, 0)
        if count == 0:
            return True
        windows = 2 ** min(count, MAX_RESEND_DOUBLINGS)
        return scope.quiet_enough(record, scope.threshold(record, older_than) * windows)

    return [r for r in records if due(r)]


def task_id_for(app: Any, record: JobRecord) -> str:
    """The Celery task id of a re-send: never a new key.

    The stored request's ``id`` (the original task id, so callers' ``AsyncResult`` converges)
    when it has one; for ``unkeyed:<task>:<id>`` the id in the key; a task the app knows with a
    ``fence_key`` gets a fresh id (its key comes from its arguments); otherwise the key itself —
    the default key is the Celery task id, and a task this app lacks may be using it.
    """
    request = record.request or {}
    stored = request.get("id")
    if isinstance(stored, str) and stored:
        return stored
    if record.key.startswith(UNKEYED_PREFIX):
        original = record.key.rsplit(":", 1)[-1]
        if original:
            return original
    task = app.tasks.get(str(request.get("task") or record.task_name))
    if task is not None and getattr(task, "fence_key", None) is not None:
        return uuid.uuid4().hex
    if len(record.key.encode()) > MAX_TASK_ID:
        raise NotResendable(
            f"job {record.key!r} may use its key as its task id, and the key is longer than "
            f"{MAX_TASK_ID} bytes: re-send it from your code"
        )
    return record.key


def routing_for(record: JobRecord, app: Any = None) -> dict[str, Any]:
    """``send_task`` routing options that reach the queue the original message reached.

    The stored request keeps the exchange and routing key as delivered. A queue of ``app``'s
    own bound that way is named (Celery declares it before the send); otherwise, with a named
    exchange, both are sent as they were (a topic or direct exchange on RabbitMQ routes on them);
    with the default exchange the routing key is the queue's name. Rows stored before the
    routing key was kept name the delivered routing key ``queue``.
    """
    options = dict((record.request or {}).get("options") or {})
    exchange = options.get("exchange") or None
    routing_key = options.get("routing_key")
    if routing_key is None:
        routing_key = options.get("queue")
    send: dict[str, Any] = {}
    if exchange and routing_key is not None:
        queue = _queue_bound(app, exchange, routing_key)
        if queue is not None:
            send["queue"] = queue
        else:
            send.update(exchange=exchange, routing_key=routing_key)
    elif routing_key:
        send["queue"] = routing_key
    if options.get("priority") is not None:
        send["priority"] = options["priority"]
    return send


def _queue_bound(app: Any, exchange: str, routing_key: str) -> str | None:
    """The name of ``app``'s queue bound to ``exchange`` with exactly ``routing_key``."""
    if app is None:
        return None
    for queue in app.amqp.queues.values():
        bound = queue.exchange.name if queue.exchange is not None else None
        if bound == exchange and queue.routing_key == routing_key:
            return str(queue.name)
    return None


def takeover_header(record: JobRecord) -> dict[str, Any] | None:
    """The :data:`~celery_fence.store.records.TAKEOVER_HEADER` of a re-send of ``record`` as
    read before it was taken: for a ``running`` job (an attempt that never ended), its
    generation and when its row last moved; None otherwise."""
    if record.status != RUNNING or record.generation < 1:
        return None
    moved = record.updated_at
    if moved.tzinfo is None:
        moved = moved.replace(tzinfo=dt.timezone.utc)
    return {"generation": record.generation, "moved": moved.timestamp()}


def execution_for(record: JobRecord) -> dict[str, Any]:
    """The ``send_task`` options that carry the job's workflow on, as stored with its request
    (chain, link, link_error, chord, group, root/parent ids, time limits, custom headers and
    stamps: Celery's own ``Task.retry`` re-sends with the same; an enqueued job's ``eta``,
    ``ignore_result`` and publish options), plus the key header."""
    stored: Mapping[str, Any] = (record.request or {}).get("execution") or {}
    options = {name: stored[name] for name in EXECUTION_OPTIONS if stored.get(name) is not None}
    headers = {
        k: v
        for k, v in (options.get("headers") or {}).items()
        if k not in (ENQUEUED_HEADER, TAKEOVER_HEADER)
    }
    options["headers"] = {**headers, KEY_HEADER: record.key}  # a re-send: registers first
    stamps = options.pop("stamps", None) or {}
    for stamp in options.get("stamped_headers") or ():
        if stamp in stamps:  # a stamp travels as an option of its own name (as_execution_options)
            options[stamp] = stamps[stamp]
    return options


def send_stored(app: Any, record: JobRecord, *, takeover: dict[str, Any] | None = None) -> str:
    """Send ``record``'s stored request again, under its key, with its workflow; return the
    Celery task id.

    The message carries the key in the ``fence_key`` header, so a worker can run it under the
    same key even when its ``fence_key`` callable would compute another (an ``unkeyed:`` job
    whose key function is fixed now). ``expires`` is not carried: the re-send must arrive.
    """
    request = dict(record.request or {})
    if not request:
        raise NotResendable(
            f"job {record.key!r} has no stored request (its arguments or workflow were not "
            "JSON): re-send it from your code"
        )
    task_name = str(request.get("task") or record.task_name)
    task_id = task_id_for(app, record)
    execution = execution_for(record)
    if takeover is not None:
        execution["headers"][TAKEOVER_HEADER] = takeover
    app.send_task(
        task_name,
        args=list(request.get("args") or []),
        kwargs=dict(request.get("kwargs") or {}),
        task_id=task_id,
        **execution,
        **routing_for(record, app),
    )
    return task_id


def resend(app: Any, store: Store, record: JobRecord, *, reason: str) -> str | None:
    """Take ``record`` for a re-send (compare-and-set to ``pending``) and send it.

    Returns the task id, or None when the row moved since it was read (another recovery, or an
    attempt, got there first). A failed send raises; the row stays ``pending`` and the next
    recovery past the threshold sends it.
    """
    if not record.request:
        raise NotResendable(
            f"job {record.key!r} has no stored request (its arguments or workflow were not "
            "JSON): re-send it from your code"
        )
    taken = store.admin.take_for_resend(record, reason=reason)
    if taken is None:
        return None
    return send_stored(app, taken, takeover=takeover_header(record))


def recover(
    app: Any,
    *,
    older_than: float | None = None,
    dry_run: bool = False,
    limit: int = DEFAULT_LIMIT,
) -> RecoveryReport:
    """Find stranded jobs and re-send each under its key (see the module docstring).

    ``older_than`` applies to every job; None (the default) judges each job by its own task's
    ``fence_recover_after``."""
    report = RecoveryReport(dry_run=dry_run)
    with Scope(app) as scope:
        found = stranded_jobs(scope, older_than=older_than, limit=limit)
    for store, record in found:
        report.stranded.append(record.key)
        if not dry_run:
            _recover_one(app, store, record, report)
    return report


def _recover_one(app: Any, store: Store, record: JobRecord, report: RecoveryReport) -> None:
    if not record.request:  # nothing to re-send: dead, where an operator sees it
        error = NotResendable(
            f"stranded {record.status} with no stored request (its arguments or workflow were "
            "not JSON): re-send it from your code"
        )
        stranded = DeadStranded(record, error, "stranded, not resendable")
        if store.end(record.key, stranded):
            report.dead.append(record.key)
            _announce(app, record, Action.DEAD, "stranded, not resendable")
        else:
            report.raced.append(record.key)
        return
    try:
        task_id = resend_announced(app, store, record, reason=f"stranded {record.status}")
    except Exception as exc:  # one job's failure must not stop the others
        report.failed.append(record.key)
        logger.error(
            "fence recover could not re-send key=%s: %s",
            record.key,
            type(exc).__name__,
            extra={"action": LogAction.RECOVER_FAILED, "fence_key": record.key, "reason": str(exc)},
        )
        return
    if task_id is None:
        report.raced.append(record.key)
        return
    report.sent.append(record.key)


def _announce(app: Any, record: JobRecord, action: Action, reason: str, **extra: Any) -> None:
    """The job's transition as recovery found it, sent by its task (or the task's name when
    this app lacks it)."""
    name = str((record.request or {}).get("task") or record.task_name)
    emit_transition(
        action,
        app.tasks.get(name, name),
        key=record.key,
        attempt_id=record.attempt_id,
        generation=record.generation,
        reason=reason,
        attempts=record.attempts,
        **extra,
    )


def resend_announced(app: Any, store: Store, record: JobRecord, *, reason: str) -> str | None:
    """:func:`resend`, then the ``job_recovered`` transition (``reason``, re-sent as ...) when
    this call took the row."""
    task_id = resend(app, store, record, reason=reason)
    if task_id is not None:
        _announce(app, record, Action.RECOVERED, f"{reason}, re-sent as {task_id}", countdown=0.0)
    return task_id


def recover_task(self: Any, older_than: float | None = None) -> dict[str, Any]:
    """The beat task's body (:data:`RECOVER_TASK`, registered per app by
    :func:`celery_fence.install`): one :func:`recover` run on this worker's app."""
    return recover(self.app, older_than=older_than).as_dict()


__all__ = [
    "DEFAULT_LIMIT",
    "KEY_HEADER",
    "MAX_RESEND_DOUBLINGS",
    "RECOVER_TASK",
    "NotResendable",
    "RecoveryReport",
    "execution_for",
    "recover",
    "recover_task",
    "resend",
    "resend_announced",
    "routing_for",
    "send_stored",
    "stranded_jobs",
    "takeover_header",
    "task_id_for",
]
