"""The stranded scan's index: the unfinished jobs by ``updated_at`` (partial).

Revision ID: celery_fence_0002
Revises: celery_fence_0001
Create Date: 2026-12-02

``fence recover`` and ``fence ls --stuck`` look for unfinished jobs that have not moved for a
while, oldest first. Without this index PostgreSQL reads all of ``fence_jobs`` (or of
``ix_fence_jobs_task_status``) to find the few unfinished ones.

The build blocks writes to ``fence_jobs`` while it runs (it runs in the upgrade's transaction).
On a large PostgreSQL table, build it first without blocking, then upgrade (this step then finds
it and skips it)::

    CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_fence_jobs_unfinished ON fence_jobs (updated_at)
        WHERE status IN ('running', 'retrying', 'pending');
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "celery_fence_0002"
down_revision: str | Sequence[str] | None = "celery_fence_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNFINISHED_PREDICATE = "status IN ('running', 'retrying', 'pending')"


def upgrade() -> None:
    op.create_index(
        "ix_fence_jobs_unfinished",
        "fence_jobs",
        ["updated_at"],
        postgresql_where=sa.text(UNFINISHED_PREDICATE),
        sqlite_where=sa.text(UNFINISHED_PREDICATE),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_fence_jobs_unfinished", table_name="fence_jobs", if_exists=True)
