"""Which PostgreSQL drivers the store runs on: psycopg 3 and psycopg2, named in the URL."""

from __future__ import annotations

import pytest

from celery_fence.errors import ConfigurationError
from celery_fence.store import Store


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("postgresql+psycopg://u@h/db", "psycopg"),
        ("postgresql+psycopg2://u@h/db", "psycopg2"),
        ("sqlite:///fence.sqlite3", "pysqlite"),
    ],
)
def test_the_store_takes_psycopg_3_and_psycopg2_urls(url: str, driver: str) -> None:
    assert Store(url).db.driver == driver  # no connection is made until the first statement


@pytest.mark.parametrize("driver", ["asyncpg", "pg8000"])
def test_another_postgresql_driver_is_refused_with_the_urls_that_work(driver: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Store(f"postgresql+{driver}://u:secret@h/db")
    message = str(refused.value)
    assert repr(driver) in message
    assert "postgresql+psycopg://" in message and "postgresql+psycopg2://" in message
