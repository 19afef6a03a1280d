"""What a user of celery-fence's pytest plugin writes once: which app, and the app's own set-up.

The plugin (loaded through its entry point) gives every test its own fence store, Redis key
prefix, queue and workers; this project keeps its own tables in the same database and sends its
notifications to a provider stub.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_fence.testing import ProviderStub


@pytest.fixture
def fence_app(fence_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from example_project import db, settings

    provider = ProviderStub()
    values = {
        "DATABASE_URL": fence_store.url,  # the project's tables beside celery-fence's
        "OBJECTS_DIR": str(tmp_path / "objects"),
        "PROVIDER_URL": provider.start(),
    }
    for name, value in values.items():
        monkeypatch.setenv(f"EXAMPLE_{name}", value)  # read by the workers' settings
        monkeypatch.setattr(settings, name, value)  # this process imported settings already
    db.engine.cache_clear()
    db.create_tables()
    db.add_orders([{"customer": f"customer-{i % 3}", "amount_cents": 500 * i} for i in range(6)])
    from example_project.app import app

    yield app
    db.metadata.drop_all(db.engine())  # the plugin clears its own rows; these are ours
    db.engine().dispose()
    db.engine.cache_clear()
    provider.stop()
