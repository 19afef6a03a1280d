"""OpenTelemetry traces with real workers: one trace from the request that enqueued a job to every
attempt (across a pause and takeover, and a recovery's re-send) and to its outbox delivery, with
and without ``opentelemetry-instrumentation-celery``.

The workers write their spans to a file (``FENCE_T_SPANS``: :mod:`tests.support.spans`); the test
process keeps its own (the request span) in memory.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest
import redis
import sqlalchemy as sa
from opentelemetry import trace

from celery_fence import enqueue, recover
from celery_fence.store import Store
from tests.support import ledger
from tests.support.spans import SpanRecord, process_exporter, read_spans, trace_id_of
from tests.support.worker import SpawnWorker, wait_until

pytestmark = [
    pytest.mark.acceptance,
    # tracing does not depend on the store: PostgreSQL only
    pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
]

#: The only attributes a fence span may carry: never args, kwargs, results or payloads.
ALLOWED = {
    "fence.key",
    "fence.generation",
    "fence.attempt",
    "fence.task",
    "fence.outcome",
    "fence.block",
    "fence.outbox_id",
    "fence.reason",
    "error.type",
}


def _attempts(path: Path, key: str) -> list[SpanRecord]:
    return [
        s
        for s in read_spans(path)
        if s.name.startswith("fence attempt ") and s.attributes.get("fence.key") == key
    ]


def _ended_attempts(path: Path, key: str, count: int, what: str) -> list[SpanRecord]:
    """The first ``count`` attempt spans of ``key`` with an outcome, by generation (bounded)."""
    wait_until(
        lambda: len([s for s in _attempts(path, key) if "fence.outcome" in s.attributes]) >= count,
        30,
        what=what,
    )
    ended = [s for s in _attempts(path, key) if "fence.outcome" in s.attributes]
    return sorted(ended, key=lambda s: s.attributes["fence.generation"])


def _children(path: Path, parent: SpanRecord) -> dict[str, SpanRecord]:
    return {s.name: s for s in read_spans(path) if s.parent_id == parent.span_id}


def _no_payloads(path: Path) -> None:
    for span in read_spans(path):
        if span.name.startswith("fence "):
            assert set(span.attributes) <= ALLOWED, span
            for event in span.events:
                assert set(event["attributes"]) <= ALLOWED, span


def test_a_takeover_and_a_recovery_resend_stay_in_the_request_trace(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    fence_store: Store,
    tmp_path: Path,
) -> None:
    process_exporter()
    spans_file = tmp_path / "spans.jsonl"
    key = f"traced:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    # Given a request span in which the job is enqueued (the message carries its traceparent) ...
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /reports") as request, engine.begin() as conn:
        enqueue(conn, client_app.work, args=(key,), kwargs={"sleep": 4.0, "check": False})
    engine.dispose()
    trace_id = trace_id_of(request)
    request_id = f"{request.get_span_context().span_id:016x}"
    # ... and worker A running it (generation 1)
    a = spawn_worker("a", FENCE_T_SPANS=str(spans_file))
    wait_until(lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 20, what="A starts")
    # When A pauses past its TTL (2 s) and recovery re-sends the job (its stored request, with
    # the traceparent) to worker B, which takes over and completes it,
    a.pause()
    time.sleep(2.6)
    spawn_worker("b", FENCE_T_SPANS=str(spans_file))
    assert key in recover(client_app.app, older_than=0).sent
    wait_until(
        lambda: (r := fence_store.get(key)) is not None and r.status == "completed",
        30,
        what="B completes",
    )
    # and A resumes: its completion is refused (stale),
    a.resume()
    first, second = _ended_attempts(spans_file, key, 2, "both attempt spans")
    record = fence_store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 2)
    # Then one trace holds the request and both attempts, each a child of the request span
    assert (first.trace_id, second.trace_id) == (trace_id, trace_id)
    assert first.parent_id == request_id and second.parent_id == request_id
    assert first.pid != second.pid
    # ... A's marked stale (a newer generation took over), B's completed
    assert (first.attributes["fence.generation"], first.attributes["fence.outcome"]) == (1, "stale")
    assert (second.attributes["fence.generation"], second.attributes["fence.outcome"]) == (
        2,
        "completed",
    )
    assert "fence.takeover" in [e["name"] for e in first.events]
    assert first.attributes["fence.attempt"] != second.attributes["fence.attempt"]
    # ... with the claim and the completion as B's children, the refused completion as A's
    assert {"fence claim", "fence complete"} <= set(_children(spans_file, second))
    refused = _children(spans_file, first)["fence complete"]
    assert (refused.status, refused.attributes["error.type"]) == ("ERROR", "StaleGeneration")
    _no_payloads(spans_file)


@pytest.mark.parametrize("instrumented", [False, True], ids=["fence-only", "celery-otel"])
def test_an_outbox_delivery_continues_the_attempt_trace(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    tmp_path: Path,
    instrumented: bool,
) -> None:
    process_exporter()
    spans_file = tmp_path / "spans.jsonl"
    key = f"effect:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    spawn_worker(
        "w", FENCE_T_SPANS=str(spans_file), FENCE_T_CELERY_OTEL="1" if instrumented else "0"
    )
    # Given a job that writes in a fenced block and stages an effect, enqueued in a request span
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request, engine.begin() as conn:
        enqueue(conn, client_app.stage_effect, args=(key,))
    engine.dispose()
    trace_id = trace_id_of(request)
    # When a worker runs it and delivers the effect
    wait_until(lambda: redis_client.llen(f"{prefix}:delivered:{key}") == 1, 30, what="the delivery")
    (attempt,) = _ended_attempts(spans_file, key, 1, "the attempt span")
    wait_until(
        lambda: any(s.name == "fence deliver traced" for s in read_spans(spans_file)),
        10,
        what="the delivery span",
    )
    (deliver,) = [s for s in read_spans(spans_file) if s.name == "fence deliver traced"]
    # Then the attempt and the delivery are in the request's trace
    assert (attempt.trace_id, deliver.trace_id) == (trace_id, trace_id)
    assert attempt.attributes["fence.outcome"] == "completed"
    assert deliver.attributes["fence.key"] == key and deliver.status == "UNSET"
    children = _children(spans_file, attempt)
    assert {"fence claim", "fence commit", "fence complete"} <= set(children)
    assert children["fence commit"].attributes["fence.block"] == "sqlalchemy"
    spans = {s.span_id: s for s in read_spans(spans_file)}
    if instrumented:
        # the instrumentation's span of the task run is the attempt's parent, in the same trace
        parent = spans[attempt.parent_id] if attempt.parent_id else None
        assert parent is not None and parent.name.startswith("run/"), parent
        assert parent.trace_id == trace_id
    else:
        # the attempt is the request span's child; the delivery, the attempt's
        assert attempt.parent_id == f"{request.get_span_context().span_id:016x}"
        assert deliver.parent_id == attempt.span_id
    _no_payloads(spans_file)


def test_a_fence_resend_keeps_the_trace(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    tmp_path: Path,
) -> None:
    process_exporter()
    spans_file = tmp_path / "spans.jsonl"
    key = f"flaky:{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}:fail_times:{key}", 1)  # the first attempt fails, transiently
    engine = sa.create_engine(db_url)
    spawn_worker("w", FENCE_T_SPANS=str(spans_file))
    # Given a job enqueued in a request span whose first attempt fails and is re-sent
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /flaky") as request, engine.begin() as conn:
        enqueue(conn, client_app.work, args=(key,), kwargs={"fail": "transient"})
    engine.dispose()
    # When the fence's re-send (``fence_resends`` header) runs it again
    first, second = _ended_attempts(spans_file, key, 2, "both attempt spans")
    # Then both attempts are children of the request span: the re-send carried its traceparent
    request_id = f"{request.get_span_context().span_id:016x}"
    assert (first.parent_id, second.parent_id) == (request_id, request_id)
    assert {first.trace_id, second.trace_id} == {trace_id_of(request)}
    assert (first.attributes["fence.outcome"], second.attributes["fence.outcome"]) == (
        "retry",
        "completed",
    )
    _no_payloads(spans_file)
