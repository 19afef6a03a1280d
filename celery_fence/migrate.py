"""Schema migrations: the Alembic scripts shipped in ``celery_fence/migrations``.

``celery -A proj fence init-db`` calls :func:`upgrade`, which creates the tables on an empty
database, upgrades an older celery-fence schema, and *stamps* a database whose tables were made
by ``metadata.create_all`` (``Store.create_schema``) instead of failing on them. The history is
kept in its own version table, ``fence_alembic_version``, so it never clashes with a project's
``alembic_version``.

Projects that already run Alembic have two ways to include celery-fence:

1. **Keep it separate (recommended).** Run ``celery -A proj fence init-db`` (or
   ``celery_fence.migrate.upgrade(url)``) in the deploy step next to ``alembic upgrade head``, and
   keep your autogenerate from proposing to drop our tables — in your ``env.py``::

       from celery_fence.migrate import include_name
       context.configure(..., include_name=include_name)

   (or chain it with your own filter: it returns False only for celery-fence's tables and
   version table).

2. **Put our revisions in your history.** Add our versions to your ``alembic.ini``::

       version_locations = %(here)s/versions celery_fence:migrations/versions

   Our revisions carry the branch label ``celery_fence`` and start a branch of their own, so
   use ``alembic upgrade heads`` (plural), and give autogenerate both metadatas::

       import celery_fence
       target_metadata = [myapp.metadata, celery_fence.metadata]

   Their history then lives in your version table; do not also run ``init-db`` on that database.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa

from celery_fence.errors import ConfigurationError
from celery_fence.schema import metadata

#: Alembic version table of celery-fence's own history.
VERSION_TABLE = "fence_alembic_version"
#: The branch label on every celery-fence revision.
BRANCH = "celery_fence"
#: The tables celery-fence owns (``schema.py``).
TABLES = frozenset(metadata.tables)
#: Tables a later revision added, each with the revision of the schema without it: a database
#: whose tables an older ``create_all`` made lacks them, and is stamped there, then upgraded.
LATER_TABLES = {"fence_steps": "celery_fence_0001", "fence_beat_ticks": "celery_fence_0001"}

Action = Literal["created", "upgraded", "stamped", "current"]


@contextlib.contextmanager
def script_location() -> Iterator[Path]:
    """The directory of the shipped migrations, as a real path for Alembic."""
    with resources.as_file(resources.files("celery_fence") / "migrations") as path:
        yield Path(path)


def alembic_config(url: str, *, connection: Any = None) -> Any:
    """An Alembic ``Config`` for celery-fence's migrations against ``url``.

    Use it inside :func:`script_location`'s ``with`` (the path must exist while Alembic runs).
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def include_name(name: str | None, type_: str, parent_names: Any = None) -> bool:
    """An Alembic ``include_name`` hook that hides celery-fence's tables from your autogenerate."""
    if type_ == "table":
        return name not in TABLES and name != VERSION_TABLE
    return True


def current(url: str) -> tuple[str, ...]:
    """The celery-fence revisions the database at ``url`` is stamped with (empty: none)."""
    from alembic.runtime.migration import MigrationContext

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return tuple(context.get_current_heads())
    finally:
        engine.dispose()


def head() -> str:
    """The newest shipped revision."""
    from alembic.script import ScriptDirectory

    with script_location() as location:
        cfg = alembic_config("sqlite://")
        cfg.set_main_option("script_location", str(location))
        heads = ScriptDirectory.from_config(cfg).get_heads()
    if len(heads) != 1:  # pragma: no cover - a packaging mistake
        raise ConfigurationError(f"celery-fence ships {len(heads)} migration heads, expected 1")
    return str(heads[0])


def upgrade(url: str, revision: str = "heads") -> Action:
    """Create or upgrade celery-fence's tables at ``url`` to ``revision`` (default: the newest).

    Returns what was done: ``created`` (empty database), ``upgraded``, ``current`` (nothing to
    do), or ``stamped`` (the tables existed, made by ``metadata.create_all``, without a version:
    they are recorded as the newest revision — ``create_all`` always makes the newest schema).
    A database holding only some of the tables is refused with an error naming the missing ones.
    """
    from alembic import command

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn, script_location() as location:
            cfg = alembic_config(url, connection=conn)
            cfg.set_main_option("script_location", str(location))
            existing = set(sa.inspect(conn).get_table_names())
            ours = existing & TABLES
            if VERSION_TABLE not in existing and ours:
                missing = sorted(TABLES - ours)
                if missing and set(missing) <= set(LATER_TABLES):  # an older create_all's
                    command.stamp(cfg, min(LATER_TABLES[name] for name in missing))
                    command.upgrade(cfg, revision)
                    return "upgraded"
                if missing:
                    raise ConfigurationError(
                        f"the database has some celery-fence tables but not {', '.join(missing)}"
                        " and no fence_alembic_version: drop the partial tables, or create the "
                        "missing ones with celery_fence.metadata.create_all, then run init-db"
                    )
                command.stamp(cfg, revision)
                return "stamped"
            before = _heads(conn)
            command.upgrade(cfg, revision)
            after = _heads(conn)
    finally:
        engine.dispose()
    if before == after:
        return "current"
    return "created" if not before else "upgraded"


def _heads(conn: sa.Connection) -> tuple[str, ...]:
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return tuple(sorted(context.get_current_heads()))
