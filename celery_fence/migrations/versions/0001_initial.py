"""The initial schema: fence_jobs, fence_transitions, fence_outbox (celery_fence/schema.py).

Revision ID: celery_fence_0001
Revises:
Create Date: 2025-01-01

Written out rather than imported from ``schema.py``: a migration is frozen at its revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "celery_fence_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("celery_fence",)
depends_on: str | Sequence[str] | None = None

KEY_LENGTH = 512
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
Timestamp = sa.DateTime(timezone=True)
FINISHED_PREDICATE = "status IN ('completed', 'dead')"


def upgrade() -> None:
    op.create_table(
        "fence_jobs",
        sa.Column("key", sa.String(KEY_LENGTH), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("result", Json, nullable=True),
        sa.Column("request", Json, nullable=True),
        sa.Column("error_type", sa.String(255), nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.Column("retry_at", Timestamp, nullable=True),
    )
    op.create_index(
        "ix_fence_jobs_finished",
        "fence_jobs",
        ["finished_at"],
        postgresql_where=sa.text(FINISHED_PREDICATE),
        sqlite_where=sa.text(FINISHED_PREDICATE),
    )
    op.create_index("ix_fence_jobs_task_status", "fence_jobs", ["task_name", "status"])

    op.create_table(
        "fence_transitions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(KEY_LENGTH), nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=True),
        sa.Column("attempt_id", sa.String(64), nullable=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("reason", sa.String(255), nullable=True),
        sa.Column("at", Timestamp, nullable=False),
    )
    op.create_index("ix_fence_transitions_key_id", "fence_transitions", ["key", "id"])

    op.create_table(
        "fence_outbox",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(KEY_LENGTH), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=False, unique=True),
        sa.Column("payload", Json, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("available_at", Timestamp, nullable=False),
        sa.Column("claimed_by", sa.String(64), nullable=True),
        sa.Column("claimed_until", Timestamp, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("delivered_at", Timestamp, nullable=True),
    )
    op.create_index("ix_fence_outbox_status_available", "fence_outbox", ["status", "available_at"])
    op.create_index("ix_fence_outbox_key", "fence_outbox", ["key"])


def downgrade() -> None:
    op.drop_table("fence_outbox")
    op.drop_table("fence_transitions")
    op.drop_table("fence_jobs")
