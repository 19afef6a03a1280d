"""The Alembic migrations are package files, so ``celery fence init-db`` works from a wheel."""

from __future__ import annotations


def test_migrations_ship_as_package_files() -> None:
    from importlib import resources

    root = resources.files("celery_fence") / "migrations"
    assert (root / "env.py").is_file() and (root / "script.py.mako").is_file()
    assert (root / "versions" / "0001_initial.py").is_file()
