"""The provider stub counts what it really performed under each idempotency key."""

from __future__ import annotations

import http.client
import json

from celery_fence.testing import ProviderStub


def _post(stub: ProviderStub, path: str, key: str, body: dict[str, object]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", stub.port, timeout=5)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Idempotency-Key": key})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_an_idempotent_provider_performs_a_key_once_and_counts_the_replays() -> None:
    with ProviderStub() as stub:
        # Given three requests with one key
        for _ in range(3):
            assert _post(stub, "/emails", "k1", {"to": "a"}) == 200
        # Then it performed once, and says so per key
        by_key = stub.stats()["by_key"]
        assert (by_key["k1"]["requests"], by_key["k1"]["performed"]) == (3, 1)
        assert stub.stats()["performed"] == 1


def test_a_provider_without_idempotency_performs_every_repeat_and_counts_them_per_key() -> None:
    with ProviderStub(idempotent=False) as stub:
        # Given the same key sent three times to a provider that ignores it
        for _ in range(3):
            assert _post(stub, "/emails", "k1", {"to": "a"}) == 200
        assert _post(stub, "/emails", "k2", {"to": "b"}) == 200
        # Then each repeat was performed, and the per-key count shows the duplicates
        by_key = stub.stats()["by_key"]
        assert (by_key["k1"]["requests"], by_key["k1"]["performed"]) == (3, 3)
        assert (by_key["k2"]["requests"], by_key["k2"]["performed"]) == (1, 1)
        assert stub.stats()["performed"] == 4


def test_a_request_that_failed_before_performing_is_not_counted() -> None:
    with ProviderStub() as stub:
        stub.fail_next(1)
        assert _post(stub, "/emails", "k1", {"to": "a"}) == 503
        assert _post(stub, "/emails", "k1", {"to": "a"}) == 200
        assert stub.stats()["by_key"]["k1"]["performed"] == 1
