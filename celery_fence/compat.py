"""Drop-in bases for code written against celery-once and celery-singleton, as fenced unique
jobs (:mod:`celery_fence.adapters.unique`): the "lock" is the job's own row, released by the
job's end (completed, dead) — never by a TTL, so a worker killed mid-run (SIGKILL, OOM, a hard
time limit) leaves no stranded lock: its job runs again within one lease TTL of its lease's end
(a workers' recovery check, every half TTL, or the next send of its key re-sends it).

celery-once::

    from celery_fence.compat import AlreadyQueued, QueueOnce

    @app.task(base=QueueOnce, once={"keys": ["a"], "graceful": True})
    def slow_add(a, b): ...

``once``: ``keys`` (the argument names the uniqueness key is made of; default all),
``graceful`` (a duplicate returns ``None`` instead of raising :class:`AlreadyQueued`),
``unlock_before_run`` (the key is held while the job is queued only) and ``timeout`` (accepted
and not needed: a lock that outlives its worker is what the job row prevents; give
``fence_unique_period`` for an upper bound of the hold). ``.apply_async(..., once={...})``
overrides them per call. The ``ONCE`` setting (its Redis backend) is not read.

celery-singleton::

    from celery_fence.compat import DuplicateTaskError, Singleton

    @app.task(base=Singleton, unique_on=["a"], raise_on_duplicate=False)
    def add(a, b): ...

A duplicate send returns the unfinished job's ``AsyncResult`` (``raise_on_duplicate``: raises
:class:`DuplicateTaskError` naming its task id). ``lock_expiry`` (and ``singleton_lock_expiry``)
is accepted and not needed. ``singleton_raise_on_duplicate`` is read from the app's
configuration as celery-singleton reads it; ``singleton_backend_url`` and
``singleton_key_prefix`` are not (the lock is the store's row).

Both are :class:`~celery_fence.FencedTask` subclasses: each job runs fenced (a lease, a
generation, the store's row), acks late, and its messages carry the fence's headers.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from celery import states
from celery.result import EagerResult

from celery_fence.adapters import unique as unique_jobs
from celery_fence.adapters.task import FencedTask
from celery_fence.errors import AlreadyEnqueued, ConfigurationError


class AlreadyQueued(AlreadyEnqueued):
    """celery-once's duplicate: an unfinished job holds this task's uniqueness key.

    ``countdown`` is celery-once's seconds until the lock expires: None here, since no lock
    expires — the key is released when that job ends."""

    default = "an unfinished job of this task and arguments is already queued or running"
    countdown: int | None = None


class DuplicateTaskError(AlreadyEnqueued):
    """celery-singleton's duplicate (``raise_on_duplicate``): ``task_id`` is the unfinished job's
    task id."""

    default = "an unfinished job of this task and arguments exists"


def _named_args(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (celery-once's and celery-singleton's ``getcallargs`` of
    ``run``), defaults included."""
    try:
        bound = inspect.signature(task.run).bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigurationError(
            f"{task.name}: these arguments do not fit its run(): {exc}"
        ) from None
    bound.apply_defaults()
    named = dict(bound.arguments)
    for name, param in inspect.signature(task.run).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:  # **kwargs: flattened, as upstream
            named.update(named.pop(name, None) or {})
    return named


def _key_on(
    task: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    names: Iterable[str] | None,
) -> str:
    named = _named_args(task, args, kwargs)
    wanted = sorted(named) if names is None else list(names)
    missing = [n for n in wanted if n not in named]
    if missing:
        raise ConfigurationError(
            f"{task.name}: the uniqueness key names {', '.join(missing)}, which run() does not "
            "take; give the names of its arguments"
        )
    return unique_jobs.default_unique_key(task.name, (), named, keys=wanted)


class QueueOnce(FencedTask, fence_base=True):
    """celery-once's ``QueueOnce`` as a fenced unique task (see the module docstring)."""

    once: ClassVar[dict[str, Any]] = {}

    def unique_policy(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        unique: bool | str | None = None,
        on_conflict: str | None = None,
    ) -> Any:
        if unique is not None:  # enqueue(..., unique=...) decides
            return super().unique_policy(args, kwargs, unique=unique, on_conflict=on_conflict)
        return self._once_policy(args, kwargs, self.once, on_conflict or "raise")

    def _once_policy(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], once: Mapping[str, Any], on: str
    ) -> unique_jobs.UniquePolicy:
        unknown = set(once) - {"keys", "graceful", "timeout", "unlock_before_run"}
        if unknown:
            raise ConfigurationError(
                f"{self.name}: once={{...}} takes keys, graceful, timeout, unlock_before_run; "
                f"not {', '.join(sorted(unknown))}"
            )
        queued_only = bool(once.get("unlock_before_run", False))
        return unique_jobs.UniquePolicy(
            key=_key_on(self, args, kwargs, once.get("keys")),
            states=("pending",) if queued_only else unique_jobs.UNIQUE_STATES,
            period=getattr(self, "fence_unique_period", None),
            on_conflict=on,
        )

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """celery-once's ``apply_async``: a duplicate raises :class:`AlreadyQueued`, or with
        ``graceful`` returns an ``EagerResult`` in state ``REJECTED`` holding None."""
        once = {**self.once, **dict(options.pop("once", None) or {})}
        if not self._fence_send(task_id, options):
            args, kwargs = tuple(args or ()), dict(kwargs or {})
            policy = self._once_policy(args, kwargs, once, "raise")
            try:
                return self._send_unique(args, kwargs, task_id, options, policy)
            except AlreadyEnqueued as exc:
                if once.get("graceful", False):
                    return EagerResult(None, None, states.REJECTED)
                raise AlreadyQueued(
                    str(exc),
                    key=exc.key,
                    unique_key=exc.unique_key,
                    status=exc.status,
                    task_id=exc.task_id,
                ) from None
        return super().apply_async(args, kwargs, task_id, **options)


class Singleton(FencedTask, fence_base=True):
    """celery-singleton's ``Singleton`` as a fenced unique task (see the module docstring)."""

    unique_on: ClassVar[str | list[str] | None] = None
    raise_on_duplicate: ClassVar[bool | None] = None
    lock_expiry: ClassVar[float | None] = None

    def unique_policy(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        unique: bool | str | None = None,
        on_conflict: str | None = None,
    ) -> Any:
        if unique is not None:
            return super().unique_policy(args, kwargs, unique=unique, on_conflict=on_conflict)
        names = [self.unique_on] if isinstance(self.unique_on, str) else self.unique_on
        return unique_policy_for(self, args, kwargs, names, on_conflict or self._on_conflict())

    @property
    def _raise_on_duplicate(self) -> bool:
        """celery-singleton's: the task's ``raise_on_duplicate``, else the app's
        ``singleton_raise_on_duplicate``, else False."""
        if self.raise_on_duplicate is not None:
            return bool(self.raise_on_duplicate)
        return bool(self.app.conf.get("singleton_raise_on_duplicate", False))

    def _on_conflict(self) -> str:
        return "raise" if self._raise_on_duplicate else "return"

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """celery-singleton's ``apply_async``: a duplicate returns the unfinished job's
        ``AsyncResult``, or raises :class:`DuplicateTaskError` (``raise_on_duplicate``)."""
        try:
            return super().apply_async(args, kwargs, task_id, **options)
        except DuplicateTaskError:
            raise
        except AlreadyEnqueued as exc:
            raise DuplicateTaskError(
                str(exc),
                key=exc.key,
                unique_key=exc.unique_key,
                status=exc.status,
                task_id=exc.task_id,
            ) from None

    def release_lock(self, task_args: Any = None, task_kwargs: Any = None) -> None:
        """celery-singleton's manual unlock: the unfinished job of these arguments gives its
        uniqueness key up (it runs on; the next send is a new job)."""
        args, kwargs = tuple(task_args or ()), dict(task_kwargs or {})
        policy = self.unique_policy(args, kwargs)
        store = self.fence_backends().store
        with store.db.connect() as conn:
            holder = store.pending.unique_holder(conn, policy.key)
            if holder is not None:
                store.pending.release_unique(
                    conn, holder.key, unique_key=policy.key, status=holder.status
                )

    @classmethod
    def clear_locks(cls, app: Any = None) -> None:
        """celery-singleton's "remove every lock": nothing to do. No lock outlives its job, so
        there is no stranded one to clear; a job that holds a key is unfinished, and ends."""


def unique_policy_for(
    task: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    names: Iterable[str] | None,
    on_conflict: str,
) -> unique_jobs.UniquePolicy:
    """A policy keyed on the arguments ``names`` (all: None) of ``task``'s ``run``."""
    return unique_jobs.UniquePolicy(
        key=_key_on(task, args, kwargs, names),
        states=unique_jobs.UNIQUE_STATES,
        period=getattr(task, "fence_unique_period", None),
        on_conflict=on_conflict,
    )


__all__ = ["AlreadyQueued", "DuplicateTaskError", "QueueOnce", "Singleton"]
