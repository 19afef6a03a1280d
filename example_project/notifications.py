"""Outbox handlers: how a committed effect reaches the provider.

Each handler gets the row's idempotency key and passes it as the provider's ``Idempotency-Key``:
the sender may deliver a row twice (a crash or a timeout after the provider did the work), and
the provider performs each key once. Raising means "failed": the outbox retries with backoff.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from . import settings
from .app import outbox


def _post(path: str, payload: Any, idempotency_key: str) -> None:
    request = urllib.request.Request(
        settings.PROVIDER_URL + path,
        data=json.dumps(payload, sort_keys=True).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=settings.PROVIDER_TIMEOUT) as response:
        response.read()  # a 4xx/5xx raises HTTPError: the outbox retries, then dead-letters


@outbox.handler("notify")
def send_notification(payload: Any, *, idempotency_key: str) -> None:
    _post("/notifications", payload, idempotency_key)


@outbox.handler("email")
def send_email(payload: Any, *, idempotency_key: str) -> None:
    _post("/emails", payload, idempotency_key)
