"""The beat scheduler's last fired tick per entry (``fence_beat_ticks``).

Revision ID: celery_fence_0004_beat
Revises: celery_fence_0003_steps
Create Date: 2026-12-04

:mod:`celery_fence.beat`'s scheduler records here the scheduled time of the last tick it sent
for each entry, so every replica (and a restarted one) knows which ticks were missed. The row
only moves forward (a conditional upsert).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "celery_fence_0004_beat"
down_revision: str | Sequence[str] | None = "celery_fence_0003_steps"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fence_beat_ticks",
        sa.Column("entry", sa.String(255), primary_key=True),
        sa.Column("last_scheduled", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_table("fence_beat_ticks", if_exists=True)
