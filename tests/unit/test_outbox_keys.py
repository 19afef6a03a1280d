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


def test_the_idempotency_namespace_is_part_of_every_key_and_empty_keeps_the_old_keys() -> None:
    import hashlib

    import pytest

    from celery_fence.body.effects import StagedEffects
    from celery_fence.config import FenceConfig
    from celery_fence.errors import ConfigurationError
    from celery_fence.ops.outbox import idempotency_key

    # The default (no namespace) gives the keys of earlier versions, byte for byte,
    old = "fence-" + hashlib.sha256(b"order:1\x00email").hexdigest()[:48]
    assert idempotency_key("order:1", "email") == old
    assert FenceConfig.from_mapping({}).idempotency_namespace == ""
    assert StagedEffects("order:1").add("email") == old
    # staging's and production's keys for the same job and effect differ (a provider account
    # they share never dedupes one environment's send against the other's),
    staging = StagedEffects("order:1", namespace="staging").add("email")
    production = StagedEffects("order:1", namespace="production").add("email")
    assert len({old, staging, production}) == 3
    assert staging == idempotency_key("order:1", "email", namespace="staging")
    assert staging.startswith("fence-staging-") and len(staging) <= 128  # the column's width
    config = FenceConfig.from_mapping({"fence_idempotency_namespace": "staging"})
    assert config.idempotency_namespace == "staging"
    # and a namespace that cannot be part of a header value is refused, naming the setting.
    for bad in ("has space", "x" * 33, "a/b", 7):
        with pytest.raises(ConfigurationError, match="fence_idempotency_namespace"):
            FenceConfig.from_mapping({"fence_idempotency_namespace": bad})
