"""Service URLs for the tests (override with environment variables)."""

from __future__ import annotations

import os

REDIS_URL = os.environ.get("FENCE_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")
BROKER_URL = os.environ.get("FENCE_TEST_BROKER_URL", "redis://127.0.0.1:6379/2")
PG_ADMIN_URL = os.environ.get(
    "FENCE_TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
)
AMQP_URL = os.environ.get("FENCE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
