"""Keys the outbox derives for effects: the same input gives the same key, on every attempt."""

from __future__ import annotations

from celery_fence.ops.outbox import storage_key


def test_storage_key_is_deterministic_per_input_version() -> None:
    # A re-run of the same export (same key, same input version) writes the same object,
    assert storage_key("export:7", 3) == storage_key("export:7", 3)
    assert storage_key("export:7", 3, suffix=".csv").endswith(".csv")
    # a new input version or another export writes a new one.
    assert storage_key("export:7", 4) != storage_key("export:7", 3)
    assert storage_key("export:8", 3) != storage_key("export:7", 3)
    assert storage_key("export:7", "3") == storage_key("export:7", 3)
