"""A completion in doubt: the database ran the completion's statement (and committed it) but its
answer never reached the worker (a crash or failover between the COMMIT and its reply). The
attempt reads the row again and, when the store says its own completion counted, ends as any
completion does: the result returned, ``job_completed`` sent (metrics, traces and Flower hang on
it). Before, it re-sent the message: the job stayed one completion, but the attempt whose write
counted never said so, and the next delivery only replayed it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_fence import FencedTask
from celery_fence import signals as fence_signals
from celery_fence.store import Store
from celery_fence.testing.proxy import TcpProxy
from tests.support.env import REDIS_URL
from tests.support.stores import with_driver


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_completion_whose_answer_was_lost_counts_and_is_announced(
    pg_url: str, proxy: TcpProxy, prefix: str, driver: str
) -> None:
    url = sa.engine.make_url(with_driver(pg_url, driver)).set(host="127.0.0.1", port=proxy.port)
    app = Celery(f"in-doubt-{prefix}", set_as_current=False)
    app.conf.update(
        fence_database_url=url.render_as_string(hide_password=False),
        fence_redis_url=REDIS_URL,
        fence_key_prefix=prefix,
        fence_lease_ttl=5,
    )

    @app.task(base=FencedTask, bind=True, fence_key=lambda marker: marker, name="t.in_doubt")
    def in_doubt(self: Any, marker: str) -> str:
        return marker[::-1]  # the result: a text no earlier statement of the attempt carries

    completed: list[tuple[str, str]] = []

    def on_completed(sender: Any = None, key: str = "", **kw: Any) -> None:
        completed.append((key, str(kw.get("attempt_id"))))

    fence_signals.job_completed.connect(on_completed, weak=False)
    marker = f"in-doubt-{uuid.uuid4().hex}"
    # Given the completion's statement (the only one carrying the result) reaches the database,
    # which commits it, and its answer is lost: the connection reset with no reply
    proxy.lose_answer_to(marker[::-1].encode())
    try:
        # when the task runs,
        result = in_doubt(marker)
    finally:
        fence_signals.job_completed.disconnect(on_completed)
        app.close()
    # then the fault happened where it was aimed (one answer lost, the row completed) ...
    assert proxy.answers_lost == 1
    store = Store(pg_url)
    try:
        record = store.get(marker)
        history = [t.action for t in store.transitions.history(marker)]
    finally:
        store.dispose()
    assert record is not None and record.status == "completed" and record.attempts == 1
    # ... and the attempt learnt that its completion counted: its result, and its announcement
    assert result == marker[::-1]
    assert completed == [(marker, record.attempt_id)], completed
    assert history.count("completed") == 1, history
