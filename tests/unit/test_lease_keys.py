"""How a logical key maps to its Redis keys (no Redis needed: naming is pure)."""

from __future__ import annotations

import pytest

from celery_fence.leases.lease import LeaseStore


@pytest.fixture
def leases() -> LeaseStore:
    """A lease store with no client: naming keys never talks to Redis."""
    return LeaseStore(None, prefix="t")


def test_keys_of_one_logical_key_share_a_hash_tag_for_any_string(leases: LeaseStore) -> None:
    for key in ["plain", "with {braces}", "ünïcode/ключ", "a" * 500, "}{"]:
        keys = leases.keys_for(key)
        tag = keys.lease[keys.lease.index("{") + 1 : keys.lease.index("}")]
        assert keys.generation == keys.lease.replace(":lease", ":gen")
        assert tag.isalnum() and f"{{{tag}}}" in keys.generation
