"""``bind=`` must name the store's own database: how two database URLs are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_fence.store.urls import different_database


def test_different_database_compares_backend_host_port_database_and_sqlite_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = sa.make_url
    pg = url("postgresql+psycopg2://postgres@127.0.0.1/app")
    assert different_database(pg, url("postgresql://u:pw@localhost:5432/app")) is None
    assert "port" in str(different_database(pg, url("postgresql://127.0.0.1:5433/app")))
    assert "host" in str(different_database(pg, url("postgresql://db.internal/app")))
    assert "database" in str(different_database(pg, url("postgresql://127.0.0.1/other")))
    assert "backend" in str(different_database(pg, url("sqlite:///app.sqlite3")))
    monkeypatch.chdir(tmp_path)
    sqlite = url(f"sqlite:///{tmp_path / 'app.sqlite3'}")
    assert different_database(sqlite, url("sqlite:///app.sqlite3")) is None
    assert different_database(sqlite, url("sqlite:///./sub/../app.sqlite3")) is None
    assert "file" in str(different_database(sqlite, url("sqlite:///other.sqlite3")))
    assert "in-memory" in str(different_database(sqlite, url("sqlite://")))


def test_the_same_postgresql_database_through_either_driver_is_the_same_database() -> None:
    url = sa.make_url
    psycopg3 = url("postgresql+psycopg://app:secret@db.internal:5432/billing")
    for theirs in (
        "postgresql+psycopg2://app@db.internal/billing",
        "postgresql://other:pw@DB.internal:5432/billing",
        "postgresql+psycopg://app@db.internal/billing",
    ):
        assert different_database(psycopg3, url(theirs)) is None, theirs
        assert different_database(url(theirs), psycopg3) is None, theirs
    assert "database" in str(
        different_database(psycopg3, url("postgresql+psycopg2://app@db.internal/other"))
    )
