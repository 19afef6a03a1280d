"""The Celery app: fenced tasks, a result store, and the outbox sender.

Run a worker with ``celery -A example_project.app worker -Q example``; put the outbox sweep in beat
(``celery -A example_project.app beat``) so rows left behind by a crash are delivered.
"""

from __future__ import annotations

from celery import Celery

from celery_fence import Outbox

from . import settings

app = Celery(
    "example_project",
    broker=settings.BROKER_URL,
    include=["example_project.tasks", "example_project.notifications"],
)
app.conf.update(
    task_default_queue=settings.QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    fence_redis_url=settings.FENCE_REDIS_URL,
    fence_database_url=settings.DATABASE_URL,
    fence_key_prefix=settings.KEY_PREFIX,
    fence_lease_ttl=settings.LEASE_TTL,
    fence_renew_interval=settings.RENEW_INTERVAL,
    fence_retry_backoff=0.3,
    fence_retry_backoff_max=5.0,
    fence_redact_celery_logs=True,  # keep task args and results out of Celery's own log lines
    beat_schedule={"outbox-sweep": {"task": "celery_fence.outbox.sweep", "schedule": 30.0}},
)

#: Effects staged with ``self.fence.effects.add(...)`` are delivered by this app's handlers.
outbox = Outbox(app, claim_ttl=30.0)
