"""The attempt's span (:mod:`celery_fence.announce.tracing`) on the in-memory doubles: its
attributes, outcome, children and events, never a payload; and tracing off at no cost: without
``opentelemetry-api`` nothing is imported or made, with the API and no SDK provider the hooks
cost microseconds. The traces of real workers are in ``tests/acceptance/test_traces.py``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace

from celery_fence.actions import Action
from celery_fence.announce import tracing
from celery_fence.announce.transitions import Announcer
from celery_fence.body.fence import Fence
from celery_fence.config import FenceConfig
from celery_fence.errors import LeaseLost
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline.execution import Execution
from celery_fence.pipeline.retry import RetryPolicy
from tests.support.memory import MemoryLeaseStore, MemoryStore
from tests.support.spans import process_exporter
from tests.support.worker import ROOT

KEY = "order:7"
SECRET = "s3cr3t-card-number"


class NoBudget:
    def record_call(self, name: str) -> None:
        pass

    def spend(self, name: str) -> float:
        return 0.0


@pytest.fixture
def attempt() -> Iterator[Callable[..., tuple[o.Disposition, list[Any]]]]:
    """``attempt(body)``: one traced execution on the doubles -> (disposition, finished spans)."""
    exporter = process_exporter()
    renewers: list[Renewer] = []

    def run(
        body: Callable[[Fence], Any], store: MemoryStore | None = None
    ) -> tuple[o.Disposition, list[Any]]:
        exporter.clear()
        config = FenceConfig(lease_ttl=2.0, renew_interval=0.5, max_attempts=3)
        leases = MemoryLeaseStore(generation_ttl=config.generation_ttl)
        renewers.append(Renewer(leases))
        trace_ = tracing.attempt_trace()
        assert trace_ is not None
        execution = Execution(
            KEY,
            task_name="orders.charge",
            config=config,
            store=store or MemoryStore(),
            leases=leases,
            renewer=renewers[-1],
            policy=RetryPolicy(config, budget=NoBudget()),  # type: ignore[arg-type]
            announcer=Announcer("orders.charge", trace=trace_),
            trace=trace_,
        )
        with (
            contextlib.suppress(Exception),
            trace_.running("orders.charge", KEY, execution.attempt_id, None),
        ):
            disposition = execution.run(
                body,
                request_json=lambda: f'{{"task": "t", "args": ["{SECRET}"], "kwargs": {{}}}}',
                max_runtime=None,
            )
            error = getattr(disposition, "error", None)
            if error is not None:  # as FencedTask carries it out: Celery's Retry, the error
                raise error
        return disposition, list(exporter.get_finished_spans())

    yield run
    for renewer in renewers:
        renewer.stop()


def _by_name(spans: list[Any]) -> dict[str, Any]:
    return {span.name: span for span in spans}


def _no_secret(spans: list[Any]) -> None:
    for span in spans:
        values = [*span.attributes.values()]
        values += [v for event in span.events for v in event.attributes.values()]
        values.append(span.status.description)
        assert all(SECRET not in str(value) for value in values), span.name


def test_a_completed_attempt_is_one_span_with_its_claim_and_completion(attempt: Any) -> None:
    disposition, spans = attempt(lambda fence: {"card": SECRET})
    assert isinstance(disposition, o.Return)
    named = _by_name(spans)
    span = named["fence attempt orders.charge"]
    assert dict(span.attributes) == {
        "fence.key": KEY,
        "fence.attempt": span.attributes["fence.attempt"],
        "fence.task": "orders.charge",
        "fence.generation": 1,
        "fence.outcome": "completed",
    }
    for child in ("fence claim", "fence complete"):
        assert named[child].parent.span_id == span.context.span_id
        assert named[child].context.trace_id == span.context.trace_id
    _no_secret(spans)


def test_a_failing_attempt_says_retry_and_a_lost_lease_is_an_event(attempt: Any) -> None:
    def fails(fence: Fence) -> Any:
        raise ConnectionError(SECRET)  # its message is never an attribute

    _, spans = attempt(fails)
    span = _by_name(spans)["fence attempt orders.charge"]
    assert span.attributes["fence.outcome"] == "retry"

    def loses(fence: Fence) -> Any:
        raise LeaseLost(f"lost while sending {SECRET}")

    _, spans = attempt(loses)
    span = _by_name(spans)["fence attempt orders.charge"]
    assert span.attributes["fence.outcome"] == "retry"
    _no_secret(spans)


def test_a_superseded_attempt_is_stale_with_a_takeover_event(attempt: Any) -> None:
    store = MemoryStore()

    def superseded(fence: Fence) -> Any:
        # a newer generation registers while this one runs
        store.register(KEY, generation=fence.generation + 1, attempt_id="b", task_name="t")
        return {"card": SECRET}

    _, spans = attempt(superseded, store)
    named = _by_name(spans)
    span = named["fence attempt orders.charge"]
    assert span.attributes["fence.outcome"] == "stale"
    assert [e.name for e in span.events] == ["fence.takeover"]
    assert named["fence complete"].attributes["error.type"] == "StaleGeneration"
    _no_secret(spans)


def test_a_transition_from_the_renewal_thread_adds_the_lease_loss() -> None:
    process_exporter().clear()
    trace_ = tracing.attempt_trace()
    assert trace_ is not None
    with trace_.running("t", KEY, "a1", None):
        Announcer("t", trace=trace_)(
            Action.LOST, key=KEY, attempt_id="a1", generation=3, reason="renewal refused"
        )
    (span,) = process_exporter().get_finished_spans()
    (event,) = span.events
    assert (event.name, dict(event.attributes or {})) == (
        "fence.lease_lost",
        {"fence.generation": 3, "fence.reason": "renewal refused"},
    )


def test_inject_puts_the_current_span_in_headers_and_nothing_outside_one() -> None:
    process_exporter()
    headers: dict[str, Any] = {}
    tracing.inject(headers)
    assert headers == {}
    with trace.get_tracer("tests").start_as_current_span("request") as span:
        tracing.inject(headers)
    assert headers[tracing.TRACEPARENT].split("-")[1] == f"{span.get_span_context().trace_id:032x}"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_the_api_nothing_is_imported_and_no_span_is_made() -> None:
    # Given a process where opentelemetry cannot be imported (as without the ``otel`` extra)
    done = _python(
        """
        import sys
        sys.modules["opentelemetry"] = None  # import raises ImportError
        from celery import Celery
        from celery_fence import FencedTask, enqueue  # noqa: F401
        from celery_fence.announce import tracing

        app = Celery("t", broker="memory://")
        app.conf.fence_redis_url = "redis://127.0.0.1:6379/6"
        app.conf.fence_database_url = "sqlite://"

        @app.task(base=FencedTask, bind=True, fence_key=lambda n: str(n))
        def job(self, n):
            return n

        execution = job.fence_execution("k", message_id="m", hostname="h")
        headers = {}
        tracing.inject(headers)
        with tracing.delivery("e", "k", 1, None) as delivery, tracing.child("c", {}) as child:
            pass
        print(tracing.ENABLED, execution.trace, execution.announcer.trace, headers, delivery,
              child, tracing.attempt_trace(),
              sorted(m for m, mod in sys.modules.items() if mod and m.startswith("opentelemetry")))
        """
    )
    # Then tracing is off: no trace object, no span, no header, nothing of opentelemetry loaded
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "None", "{}", "None", "None", "None", "[]"]


def test_with_the_api_and_no_provider_an_attempt_makes_no_span() -> None:
    # Given the API but no TracerProvider set (its default: a proxy to the no-op tracer)
    done = _python(
        """
        import time
        from opentelemetry.sdk.trace import Span
        from celery_fence.announce import tracing

        made = []
        Span.__init__ = lambda self, *a, **kw: made.append(a)  # any SDK span made is seen
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10_000):
                assert tracing.attempt_trace() is None
            best = min(best, (time.perf_counter() - start) / 10_000)
        print(tracing.ENABLED, tracing.configured(), len(made), best)
        """
    )
    assert done.returncode == 0, done.stderr
    enabled, configured, made, seconds = done.stdout.split()
    # Then no attempt trace, no span: the hooks cost one isinstance per attempt
    assert (enabled, configured, made) == ("True", "False", "0")
    assert float(seconds) < 20e-6, f"{float(seconds) * 1e6:.2f} µs per attempt"
