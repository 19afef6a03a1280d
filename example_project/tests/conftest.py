"""What a user of celery-fence's pytest plugin writes once: which app, and the app's own set-up.

The plugin (loaded through its entry point) gives every test its own Redis key prefix, queue and
workers. This project's fence settings name its own database (``fence_database_url`` is
``EXAMPLE_DATABASE_URL``), so the plugin's store is that database, beside the project's own
tables: here a SQLite file per test, set before the app is handed over. Its outbox handlers are
not called by the plugin's workers (they deliver to a recording handler); the provider stub is
there for ``--fence-real-outbox``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_fence.testing import ProviderStub


@pytest.fixture
def fence_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from example_project import db, settings
    from example_project.app import app

    provider = ProviderStub()
    values = {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'example.sqlite3'}",  # the project's database
        "OBJECTS_DIR": str(tmp_path / "objects"),
        "PROVIDER_URL": provider.start(),
    }
    for name, value in values.items():
        monkeypatch.setenv(f"EXAMPLE_{name}", value)  # read by the workers' settings
        monkeypatch.setattr(settings, name, value)  # this process imported settings already
    before = app.conf.fence_database_url
    app.conf.fence_database_url = values["DATABASE_URL"]  # as the app's settings would say
    db.engine.cache_clear()
    db.create_tables()
    db.add_orders([{"customer": f"customer-{i % 3}", "amount_cents": 500 * i} for i in range(6)])
    yield app
    app.conf.fence_database_url = before
    db.metadata.drop_all(db.engine())  # the plugin clears its own rows; these are ours
    db.engine().dispose()
    db.engine.cache_clear()
    provider.stop()
