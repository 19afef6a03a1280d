"""Settings from the environment, with defaults for a laptop (the demo sets its own)."""

from __future__ import annotations

import os

E = os.environ

#: The Celery broker.
BROKER_URL = E.get("EXAMPLE_BROKER_URL", "redis://127.0.0.1:6379/3")
#: Redis for celery-fence's leases and generation counters.
FENCE_REDIS_URL = E.get("EXAMPLE_FENCE_REDIS_URL", BROKER_URL)
#: The application database; celery-fence's tables live in it too.
DATABASE_URL = E.get("EXAMPLE_DATABASE_URL", "sqlite:///example_project.sqlite3")
#: Prefix of every Redis key celery-fence writes (and the queue's name).
KEY_PREFIX = E.get("EXAMPLE_KEY_PREFIX", "example")
QUEUE = E.get("EXAMPLE_QUEUE", "example")
#: Seconds a lease lives without renewal, and between renewals.
LEASE_TTL = float(E.get("EXAMPLE_LEASE_TTL", "30"))
RENEW_INTERVAL = float(E.get("EXAMPLE_RENEW_INTERVAL", str(LEASE_TTL / 3)))
#: The notification/email provider (celery_fence.testing.ProviderStub in the demo).
PROVIDER_URL = E.get("EXAMPLE_PROVIDER_URL", "http://127.0.0.1:8025")
PROVIDER_TIMEOUT = float(E.get("EXAMPLE_PROVIDER_TIMEOUT", "5"))
#: Where exported files go (a local stand-in for an object store bucket).
OBJECTS_DIR = E.get("EXAMPLE_OBJECTS_DIR", "objects")
#: Seconds of simulated work in each job (the demo makes jobs slow enough to pause a worker).
WORK_SECONDS = float(E.get("EXAMPLE_WORK_SECONDS", "0"))
