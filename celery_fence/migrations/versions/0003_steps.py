"""The completed steps and the checkpoint of each job: ``fence_steps`` (``fence.step()``,
``fence.checkpoint()``).

Revision ID: celery_fence_0003_steps
Revises: celery_fence_0002
Create Date: 2026-12-04

Written out rather than imported from ``schema.py``: a migration is frozen at its revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "celery_fence_0003_steps"
down_revision: str | Sequence[str] | None = "celery_fence_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY_LENGTH = 512
Json = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
Timestamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "fence_steps",
        sa.Column("key", sa.String(KEY_LENGTH), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("value", Json, nullable=True),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_table("fence_steps", if_exists=True)
