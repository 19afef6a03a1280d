"""The producer's side of a fenced task (:class:`FencedSending`, a base of
:class:`~celery_fence.adapters.task.FencedTask`): its ``apply_async``, which gives the attempt's
lease back before the body's own retry is published, stamps the publish time, and first writes
a unique task's ``pending`` row with its uniqueness key (:mod:`celery_fence.adapters.unique`);
and the headers and request flag that a fenced publish carries."""

from __future__ import annotations

import datetime as dt
import time
from typing import TYPE_CHECKING, Any

from celery import Task

from celery_fence.adapters import unique as unique_jobs
from celery_fence.adapters.metrics import stamps_publish
from celery_fence.adapters.request import encode_request
from celery_fence.errors import ConfigurationError
from celery_fence.ops.recovery import KEY_HEADER
from celery_fence.pipeline.execution import Execution
from celery_fence.store import Store
from celery_fence.store.records import ENQUEUED_HEADER

if TYPE_CHECKING:
    from celery_fence.pipeline.backends import Backends

#: The header counting the fence's own re-sends of a message (busy lease, store unavailable, the
#: fence's retry policy). They keep Celery's ``retries`` as it was: the task's ``max_retries``
#: counts the body's own ``self.retry()`` and ``autoretry_for`` only, as in plain Celery.
RESENDS_HEADER = "fence_resends"

#: Request flag: the body's ``retry()`` is about to send its message (release the lease first).
RELEASE_BEFORE_SEND = "fence_release_before_send"
#: The header :meth:`FencedTask.apply_async` stamps when metrics may be on (``stamps_publish``):
#: the wall-clock time of the publish, from which the metrics' queue wait runs
#: (``celery_fence_queue_wait_seconds``).
PUBLISHED_HEADER = "fence_published_at"


def published_at(request: Any) -> float | None:
    """When ``request``'s message was published (:data:`PUBLISHED_HEADER`), or its ETA when
    that is later: the start of its queue wait. None when the message does not say."""
    stamp = request.get(PUBLISHED_HEADER)
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool):
        return None
    eta = request.get("eta")
    if isinstance(eta, str):
        try:
            when = dt.datetime.fromisoformat(eta)
        except ValueError:
            return float(stamp)
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        return max(float(stamp), when.timestamp())
    return float(stamp)


class FencedSending(Task):
    """``apply_async`` of a fenced task: a base of
    :class:`~celery_fence.adapters.task.FencedTask`, never used alone."""

    if TYPE_CHECKING:  # FencedTask's

        def logical_key(self, args: Any, kwargs: Any, task_id: str | None) -> str: ...

        def fence_backends(self) -> Backends: ...

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """Celery's ``apply_async``; when it publishes the body's own retry
        (:meth:`~celery_fence.adapters.resend.FencedResending.retry`), this attempt's lease is
        given back first. A task with ``fence_unique`` first writes its job's ``pending`` row
        with its uniqueness key (:meth:`_send_unique`)."""
        request = self.request
        if request.get(RELEASE_BEFORE_SEND):
            setattr(request, RELEASE_BEFORE_SEND, False)
            fence = request.get("fence")
            if fence is not None and isinstance(fence.execution, Execution):
                fence.execution.release_before_retry()
        if stamps_publish(self.app):  # the publish time, for the metrics' queue wait
            options["headers"] = {**(options.get("headers") or {}), PUBLISHED_HEADER: time.time()}
        if not self._fence_send(task_id, options):
            args, kwargs = tuple(args or ()), dict(kwargs or {})
            policy = self.unique_policy(args, kwargs)
            if policy is not None:
                return self._send_unique(args, kwargs, task_id, options, policy)
        return super().apply_async(args, kwargs, task_id, **options)

    def unique_policy(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        unique: bool | str | None = None,
        on_conflict: str | None = None,
    ) -> unique_jobs.UniquePolicy | None:
        """This send's uniqueness (None: not unique): the ``fence_unique*`` options, or
        ``enqueue()``'s ``unique`` and ``on_conflict`` (:func:`unique_jobs.policy_for`). The
        celery-once and celery-singleton shims (:mod:`celery_fence.compat`) read theirs."""
        return unique_jobs.policy_for(self, args, kwargs, unique=unique, on_conflict=on_conflict)

    def _fence_send(self, task_id: str | None, options: dict[str, Any]) -> bool:
        """Whether this publish is the fence's own (an enqueue's, a recovery's, a requeue's or a
        re-send's, all naming the job's key; the body's retry of its own message) or an eager
        run: not a new send of the job, so no uniqueness check."""
        headers = options.get("headers") or {}
        if KEY_HEADER in headers or RESENDS_HEADER in headers:
            return True
        if task_id is not None and task_id == self.request.id:
            return True
        return bool(self.app.conf.task_always_eager)

    def _send_unique(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        task_id: str | None,
        options: dict[str, Any],
        policy: unique_jobs.UniquePolicy,
    ) -> Any:
        """A new send of a unique task: its job's ``pending`` row with its uniqueness key (one
        statement on the store's connection, committed before the publish: a process that dies
        in between leaves the row to ``fence recover``), then the message; or, when an
        unfinished job holds the key, that job's ``AsyncResult`` (``on_conflict="return"``) or
        :class:`~celery_fence.errors.AlreadyEnqueued` (``"raise"``)."""
        task_id = task_id or unique_jobs.new_task_id()
        key = self.logical_key(args, kwargs, task_id)
        context = unique_jobs.message_context(self, args, kwargs, task_id, options)
        stored = encode_request(self.name, args, kwargs, context)
        if stored is None:
            raise ConfigurationError(
                f"{self.name}: a unique task's arguments must be JSON (its job is stored to be "
                "re-sent); pass plain dicts, lists, str, int, float, bool or None"
            )
        due = unique_jobs.due_time(options)
        if due is not None:
            stored["execution"] = {**(stored.get("execution") or {}), "eta": due.isoformat()}
        store = self.fence_backends().store
        if not isinstance(store, Store):  # a store double (the testing plugin's): no index
            raise ConfigurationError(
                f"{self.name}: a unique task's send needs the SQL store (its unique index "
                "decides); run it eagerly (task_always_eager) or against a real store in tests"
            )
        with store.db.connect() as conn:  # AUTOCOMMIT: each statement commits on its own
            claimed = unique_jobs.claim(
                store,
                conn,
                key,
                task_name=self.name,
                request=stored,
                due=due,
                policy=policy,
                take_over=lambda holder: unique_jobs.take_over(self, store, holder),
            )
        if not claimed.created:
            holder = claimed.existing
            found = None if holder is None else unique_jobs.task_id_of(holder)
            return self.AsyncResult(found or task_id)
        headers = {**dict(options.pop("headers", None) or {}), KEY_HEADER: key, ENQUEUED_HEADER: 1}
        return super().apply_async(args, kwargs, task_id, headers=headers, **options)
