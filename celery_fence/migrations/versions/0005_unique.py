"""Unique jobs: ``fence_jobs.unique_key`` and its partial unique index on the unfinished jobs.

Revision ID: celery_fence_0005_unique
Revises: celery_fence_0004_beat
Create Date: 2026-12-04

A job enqueued with ``unique=`` (or by a task with ``fence_unique``) carries its uniqueness key;
the index admits one ``pending``, ``running`` or ``retrying`` job per key, so the store refuses a
second one in the caller's transaction. A job leaves the index by its own end (completed, dead),
never by a TTL. The column is NULL for every other job (no rewrite of existing rows).

On a large PostgreSQL table, build the index first without blocking writes, then upgrade (this
step then finds it and skips it)::

    ALTER TABLE fence_jobs ADD COLUMN IF NOT EXISTS unique_key VARCHAR(512);
    CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS ux_fence_jobs_unique_unfinished
        ON fence_jobs (unique_key)
        WHERE unique_key IS NOT NULL AND status IN ('running', 'retrying', 'pending');
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "celery_fence_0005_unique"
down_revision: str | Sequence[str] | None = "celery_fence_0004_beat"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNIQUE_PREDICATE = "unique_key IS NOT NULL AND status IN ('running', 'retrying', 'pending')"


def upgrade() -> None:
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("fence_jobs")}
    if "unique_key" not in columns:
        op.add_column("fence_jobs", sa.Column("unique_key", sa.String(512), nullable=True))
    op.create_index(
        "ux_fence_jobs_unique_unfinished",
        "fence_jobs",
        ["unique_key"],
        unique=True,
        postgresql_where=sa.text(UNIQUE_PREDICATE),
        sqlite_where=sa.text(UNIQUE_PREDICATE),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ux_fence_jobs_unique_unfinished", table_name="fence_jobs", if_exists=True)
    with op.batch_alter_table("fence_jobs") as batch:
        batch.drop_column("unique_key")
