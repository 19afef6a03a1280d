"""What a chaos run is asked to do: the scenario names, what some of them need, the options."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Every scenario, in the order ``all`` runs them.
SCENARIOS = (
    "pause",
    "app-write",
    "orm-binds",
    "django-write",
    "beside-block",
    "atomic-threads",
    "kill",
    "duplicate",
    "redis-loss",
    "db-outage",
    "unknown-remote",
    "poison",
    "time-limit",
    "expires",
    "misconfig",
    "refused-arg",
    "recovered-chain",
    "interrupted",
    "enqueue-crash",
    "broker-loss",
    "store-crash",
    "steps",
    "export",
    "unique",
    "beat",
    "group",
    "rate",
)
#: Scenarios that run against PostgreSQL whatever the store (a throwaway database if need be).
POSTGRESQL_ONLY = ("db-outage", "refused-arg", "beside-block", "atomic-threads")
#: Scenarios that start their own workers in each run (none are running in between).
OWN_WORKERS = (
    "misconfig",
    "recovered-chain",
    "interrupted",
    "enqueue-crash",
    "broker-loss",
    "store-crash",
    "beat",
    "group",
    "rate",
)
#: Scenarios whose workers run their own recovery checks, at the fence's defaults (the others
#: run recovery themselves, at the points each names: see workload.make_app).
WORKERS_RECOVER = ("unique",)
#: Scenarios that run against a PostgreSQL cluster the harness starts (and crashes) itself.
OWN_CLUSTER = ("store-crash",)


@dataclass
class Options:
    """One run of the harness, as :func:`~celery_fence.chaos.command.parse_args` reads it."""

    scenarios: Sequence[str] = SCENARIOS
    runs: int = 3
    seed: int = 0
    redis_url: str = "redis://127.0.0.1:6379/1"
    broker_url: str = "redis://127.0.0.1:6379/2"
    database_url: str | None = None  # None: a fresh SQLite file per scenario
    pg_admin_url: str = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
    ttl: float = 1.5
    max_attempts: int = 3
    workers: int = 2
    unfenced: bool = False
    unsettled: bool = False
    rerun_finished: bool = False  # the registration takes a finished job's row (control arm)
    unwatched: bool = False  # nobody watches the body's other connections (control arm)
    unfenced_steps: bool = False  # fence.run_step() is a plain call (control arm)
    rows: int = 10_000  # rows the export scenario exports
    async_endings: bool = False  # a job's endings commit without their WAL flush (control arm)
    provider_idempotent: bool = True  # False: the provider performs every repeat (control arm)
    ttl_lock: bool = False  # unique jobs guarded by a celery-once-style TTL lock (control arm)
    stock_beat: bool = False  # beat replicas run Celery's PersistentScheduler (control arm)
    duration: float = 60.0  # seconds the rate scenario measures its rate over
    no_group_limit: bool = False  # the group's task has no fence_group_limit (control arm)
    celery_rate_limit: bool = False  # Celery's per-worker rate_limit, not the fence's (control arm)
    own_redis: bool = False
    converge_timeout: float = 60.0
    remote_timeout: float = 0.5
    json_path: str | None = None
    workdir: str | None = None
    quiet: bool = False
