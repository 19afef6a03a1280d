"""What a fenced task uses in this process, made once per configuration and kept on the
process's :class:`~celery_fence.process.runtime.Runtime`: its SQL store, its Redis client, lease
store and renewer, its retry budget.

Configurations equal in what an object depends on share it: two tasks on one database share the
store, two tasks on one Redis share the client, whatever else their settings say.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from celery_fence.config import FenceConfig
from celery_fence.leases.lease import LeaseStore
from celery_fence.leases.limits import Limits
from celery_fence.leases.redis_client import client_identity, make_client
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline.retry import RetryBudget, RetryPolicy
from celery_fence.process.runtime import Runtime, runtime
from celery_fence.store import Store

#: The settings a :class:`~celery_fence.store.Store` is made with, besides the database URL:
#: configurations equal in these share one store.
STORE_SETTINGS = (
    "record_transitions",
    "error_message_length",
    "database_timeout",
    "lock_timeout",
)


class Backends(NamedTuple):
    """What one fenced task uses, resolved once per task and process."""

    config: FenceConfig
    store: Store
    leases: LeaseStore
    policy: RetryPolicy
    renewer: Renewer
    runtime: Runtime


def store_for(config: FenceConfig, store_class: type[Store] = Store) -> Store:
    """This process's store for ``config``'s database and store settings."""
    settings = {name: getattr(config, name) for name in STORE_SETTINGS}
    ident = (store_class, config.database_url, *settings.values())
    return runtime().get("store", ident, lambda: store_class(config.database_url, **settings))


def get_store(app: Any) -> Store:
    """The store an app's fenced tasks write to: ``get_store(app).get(key)``."""
    return store_for(FenceConfig.from_app(app))


def redis_client(config: FenceConfig) -> Any:
    """This process's client for ``config``'s lease Redis; leases and the retry budget share it."""
    return runtime().get("redis", client_identity(config.redis), lambda: make_client(config.redis))


def lease_store(config: FenceConfig) -> LeaseStore:
    """The lease store for ``config``'s Redis, key prefix and counter lifetime."""
    ident = (client_identity(config.redis), config.key_prefix, config.generation_ttl)
    return runtime().get(
        "leases",
        ident,
        lambda: LeaseStore(
            redis_client(config), prefix=config.key_prefix, generation_ttl=config.generation_ttl
        ),
    )


def renewer(config: FenceConfig) -> Renewer:
    """The heartbeat of :func:`lease_store`'s leases (one thread per lease store)."""
    leases = lease_store(config)
    return runtime().get("renewer", id(leases), lambda: Renewer(leases))


def limits_for(config: FenceConfig) -> Limits | None:
    """The cluster-wide limits' scripts on ``config``'s lease Redis, or None when ``config``
    sets neither a group limit nor a rate limit."""
    if config.group_limit is None and config.rate_limit is None:
        return None
    ident = (client_identity(config.redis), config.key_prefix)
    return runtime().get(
        "limits", ident, lambda: Limits(redis_client(config), prefix=config.key_prefix)
    )


def retry_budget(config: FenceConfig) -> RetryBudget:
    """The retry budgets (per task name) for ``config``'s Redis, prefix and budget settings."""
    ident = (
        client_identity(config.redis),
        config.key_prefix,
        config.retry_budget_ratio,
        config.retry_budget_floor,
        config.retry_budget_window,
    )
    return runtime().get(
        "budget", ident, lambda: RetryBudget(config, redis_client=redis_client(config))
    )


def backends(config: FenceConfig, store_class: type[Store] = Store) -> Backends:
    """Everything a fenced task with settings ``config`` uses in this process."""
    return Backends(
        config,
        store_for(config, store_class),
        lease_store(config),
        RetryPolicy(config, budget=retry_budget(config)),
        renewer(config),
        runtime(),
    )


__all__ = [
    "STORE_SETTINGS",
    "Backends",
    "backends",
    "get_store",
    "lease_store",
    "limits_for",
    "redis_client",
    "renewer",
    "retry_budget",
    "store_for",
]
