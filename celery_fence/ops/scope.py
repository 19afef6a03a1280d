"""Where an app's fenced jobs live, for the operator's side (recovery and the CLI).

A fenced task may override any setting for itself (``@app.task(base=FencedTask,
fence_database_url=..., fence_key_prefix=..., fence_redis_url=..., lease_ttl=...,
fence_recover_after=...)``). Its jobs then live in its own database and its leases under its own
Redis and prefix, and a job of it is stranded only after its own ``fence_recover_after``. A
:class:`Scope` reads each job with its task's settings: :meth:`Scope.config_for` resolves a
job's task by its stored name in the app's registry (a task the app does not know is read with
the app's settings), :meth:`Scope.databases` lists every distinct database the app's fenced tasks
write to, and :meth:`Scope.lease_held` asks the Redis and prefix of the job's own task whether a
live lease still holds it.

Settings that are invalid raise :class:`~celery_fence.errors.ConfigurationError` here as they do
at worker start and in ``fence check``, naming the task and the setting.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_fence.config import FenceConfig, Fenced
from celery_fence.leases.lease import LeaseStore, make_redis_client
from celery_fence.leases.redis_client import client_identity
from celery_fence.pipeline.backends import store_for
from celery_fence.schema import PENDING, RETRYING, RUNNING
from celery_fence.store import Store
from celery_fence.store.records import JobRecord, never_claimed


@dataclass(frozen=True)
class Database:
    """One database the app's fenced jobs live in, and the store this process reads it with."""

    url: str
    store: Store
    #: The fenced tasks that write here (empty for the app's own database when none overrides).
    tasks: tuple[str, ...]


class Scope(contextlib.AbstractContextManager["Scope"]):
    """The settings of every fenced task of ``app``, and the Redis clients the liveness checks
    open (closed on exit: ``with Scope(app) as scope: ...``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.default = FenceConfig.from_app(app)
        self._by_task: dict[str, FenceConfig] = {}
        for name, task in list(app.tasks.items()):
            if isinstance(task, Fenced):
                self._by_task[name] = FenceConfig.for_task(task)  # raises, naming the task
        self._clients: dict[tuple[Any, ...], Any] = {}
        self._leases: dict[tuple[Any, ...], LeaseStore] = {}

    # -- settings ----------------------------------------------------------------------------

    def config_for(self, task_name: str | None) -> FenceConfig:
        """The settings of the task named ``task_name`` (the app's when the app lacks it)."""
        return self._by_task.get(str(task_name), self.default)

    def config_of(self, record: JobRecord) -> FenceConfig:
        """The settings a job is read with: its task's (by the stored request's task name)."""
        return self.config_for(str((record.request or {}).get("task") or record.task_name))

    def fenced_tasks(self) -> list[str]:
        """The names of the app's fenced tasks, sorted."""
        return sorted(self._by_task)

    def configs(self) -> list[FenceConfig]:
        """The app's settings, then each fenced task's that differ."""
        out = [self.default]
        for config in self._by_task.values():
            if config not in out:
                out.append(config)
        return out

    def databases(self) -> list[Database]:
        """Every distinct database the app's fenced tasks write to, the app's own first."""
        urls: dict[str, list[str]] = {self.default.database_url: []}
        configs: dict[str, FenceConfig] = {self.default.database_url: self.default}
        for name, config in sorted(self._by_task.items()):
            urls.setdefault(config.database_url, []).append(name)
            configs.setdefault(config.database_url, config)
        return [Database(url, store_for(configs[url]), tuple(names)) for url, names in urls.items()]

    def redis_configs(self) -> list[FenceConfig]:
        """One configuration per distinct lease Redis (URL, client factory, TLS, cluster)."""
        seen: dict[tuple[Any, ...], FenceConfig] = {}
        for config in self.configs():
            seen.setdefault(client_identity(config.redis), config)
        return list(seen.values())

    # -- leases ------------------------------------------------------------------------------

    def leases_for(self, config: FenceConfig) -> LeaseStore:
        """A lease store on ``config``'s Redis and prefix (one client per Redis, this scope's)."""
        ident = client_identity(config.redis)
        client = self._clients.get(ident)
        if client is None:
            client = self._clients[ident] = make_redis_client(config.redis)
        leases = self._leases.get((ident, config.key_prefix))
        if leases is None:
            leases = self._leases[(ident, config.key_prefix)] = LeaseStore(
                client, prefix=config.key_prefix
            )
        return leases

    def lease(self, record: JobRecord) -> tuple[float | None, int | None]:
        """(seconds left, generation) of the live lease on the job's key under its own task's
        Redis and prefix; (None, None) when none holds it."""
        return self.leases_for(self.config_of(record)).remaining(record.key)

    def lease_held(self, record: JobRecord) -> bool:
        """True while a live lease holds the job's key (looked up where its task claims it)."""
        return self.lease(record)[0] is not None

    def held(self, records: Sequence[JobRecord]) -> set[str]:
        """The keys of ``records`` a live lease holds: one round trip per lease Redis and prefix."""
        by_store: dict[int, tuple[LeaseStore, list[str]]] = {}
        for record in records:
            leases = self.leases_for(self.config_of(record))
            by_store.setdefault(id(leases), (leases, []))[1].append(record.key)
        return {key for leases, keys in by_store.values() for key in leases.held(keys)}

    def quiet_enough(
        self, record: JobRecord, older_than: float | None, now: dt.datetime | None = None
    ) -> bool:
        """True when the job has not moved for ``older_than`` seconds, or, when None, for its own
        task's ``fence_recover_after`` (``fence_recover_pending_after`` for a job never claimed);
        a ``retrying`` job, or a ``pending`` one enqueued with a countdown or eta, is counted from
        its due time too."""
        threshold = self.threshold(record, older_than)
        if threshold <= 0 and record.status == RUNNING:
            return True  # its lease alone decides (no clock of another host compared)
        cutoff = (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(seconds=threshold)
        moved = _utc(record.updated_at)
        if record.status in (RETRYING, PENDING) and record.retry_at is not None:
            moved = max(moved, _utc(record.retry_at))
        return moved < cutoff

    def threshold(self, record: JobRecord, older_than: float | None) -> float:
        """``older_than``, or the job's own task's threshold: none (0) for a ``running`` job
        (renewed every fraction of its TTL, its lease's absence is the signal),
        ``fence_recover_pending_after`` for a job never claimed, ``fence_recover_after`` for a
        ``retrying`` or re-sent ``pending`` one."""
        if older_than is not None:
            return older_than
        if record.status == RUNNING:
            return 0.0
        if never_claimed(record):
            return self.config_of(record).recover_pending_after_seconds
        return self.config_of(record).recover_after_seconds

    def min_threshold(self, older_than: float | None) -> float:
        """The smallest quiet time a ``retrying`` or ``pending`` job may be stranded after (the
        database scan's; a ``running`` one is scanned at ``older_than``, or at any age)."""
        if older_than is not None:
            return older_than
        return min(config.recover_pending_after_seconds for config in self.configs())

    def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                close = getattr(client, "close", None)
                if close is not None:
                    close()
        self._clients.clear()
        self._leases.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _utc(value: dt.datetime) -> dt.datetime:
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value


__all__ = ["Database", "Scope"]
