"""Alembic environment of celery-fence's own migrations (``celery fence init-db`` runs it).

It keeps its history in its own version table, ``fence_alembic_version``, so it never meets a
project's ``alembic_version``. :func:`celery_fence.migrate.upgrade` hands it an open connection
through ``config.attributes["connection"]``; run by the ``alembic`` command instead, it connects
to ``sqlalchemy.url``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from celery_fence.migrate import VERSION_TABLE
from celery_fence.schema import metadata

config = context.config


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,  # SQLite alters tables by copy; harmless elsewhere
        compare_type=True,
        **kwargs,  # type: ignore[arg-type]
    )


def run_offline() -> None:
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = sa.create_engine(
        config.get_main_option("sqlalchemy.url") or "", poolclass=sa.pool.NullPool
    )
    with engine.connect() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
