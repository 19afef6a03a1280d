"""OpenTelemetry traces of fenced jobs: one place, optional, off at zero cost.

With ``opentelemetry-api`` installed (the ``otel`` extra), every attempt of a fenced task is a span
``fence attempt <task name>`` made through the global TracerProvider (a no-op unless the app
configured one), with the attributes ``fence.key``, ``fence.generation``, ``fence.attempt`` (the
attempt id), ``fence.task`` and, set at the settle step, ``fence.outcome`` (``completed``,
``replayed``, ``stale``, ``retry``, ``dead``, ``failed``, ``busy``, ``time_limit``, ...: the
value of the last transition the attempt announced, ``retry_scheduled`` written ``retry``; a
``stale`` attempt stays stale when its message is re-sent to converge on the newer result). Its
children: ``fence claim`` (the claim and the registration), ``fence commit`` (each fenced
block's commit: ``fence.transaction()``/``session()``, Django's ``fence.atomic()``) and
``fence complete`` (the completion's fenced write); its events: ``fence.lease_lost`` (from the
renewal thread or the task) and ``fence.takeover`` (a newer generation took the job over: this
attempt settles stale; its ``fence.reason`` names the stored generation). An outbox delivery is
a span ``fence deliver <effect name>``.
Never args, kwargs, results or payloads: key, attempt id, generation, reason only.

The trace travels with the job: :func:`celery_fence.enqueue` puts the caller's context in the
message's headers as ``traceparent`` (W3C), stored with the ``pending`` row's request; the
fence's re-sends and recovery's re-sends carry the stored headers on; the outbox's deliver task
is sent with the completing attempt's context. An attempt's span is the child of the current
span when there is one (``opentelemetry-instrumentation-celery``'s span of the task run), else
of the message's ``traceparent``: request, commit, publish, every attempt (across a takeover)
and the effect's delivery are one trace.

Without ``opentelemetry-api`` (:data:`ENABLED` False) nothing here is imported and every hook
returns before making anything; with the API but no TracerProvider set by the app, an attempt
makes no span object either (:func:`configured`: one ``isinstance`` per attempt).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from celery_fence.actions import Action

try:  # the ``otel`` extra
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode

    _NO_OP_PROVIDERS: tuple[type, ...] = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
except ImportError:  # pragma: no cover - exercised in a process that hides the API
    trace = None  # type: ignore[assignment]
    _NO_OP_PROVIDERS = ()

logger = logging.getLogger("celery_fence")

#: Whether ``opentelemetry-api`` is importable: without it tracing is off at zero cost.
ENABLED = trace is not None
#: The instrumentation scope of celery-fence's spans.
TRACER_NAME = "celery_fence"
#: The W3C header a message carries its trace in.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: ``fence.outcome`` of each transition an attempt ends with (the last one it announced wins).
OUTCOMES: Mapping[Action, str] = {
    Action.COMPLETED: "completed",
    Action.REPLAYED: "replayed",
    Action.STALE: "stale",
    Action.RETRY_SCHEDULED: "retry",
    Action.DEAD: "dead",
    Action.FAILED: "failed",
    Action.BUSY: "busy",
    Action.TIME_LIMIT: "time_limit",
    Action.EXPIRED: "expired",
    Action.REVOKED: "revoked",
}


def _tracer() -> Any:
    return trace.get_tracer(TRACER_NAME)


def _parent_context(headers: Mapping[str, Any] | None) -> Any:
    """The current context when a span is active in it (the app's own, or the Celery
    instrumentation's span of this task run), else the one ``headers`` carry (None: none)."""
    if trace.get_current_span().get_span_context().is_valid:
        return None  # start_span takes the current context
    carrier = {k: v for k, v in (headers or {}).items() if k in (TRACEPARENT, TRACESTATE)}
    if not carrier or not isinstance(carrier.get(TRACEPARENT), str):
        return None
    return propagate.extract(carrier)


def message_headers(request: Any) -> dict[str, Any]:
    """The trace headers of a Celery task request (a worker's: custom headers are the request's
    own fields; an eager ``apply(headers=...)``: its ``headers``)."""
    if request is None:
        return {}
    found: dict[str, Any] = {}
    headers = getattr(request, "headers", None)
    fields = getattr(request, "__dict__", None) or {}
    for source in (headers if isinstance(headers, Mapping) else {}, fields):
        for name in (TRACEPARENT, TRACESTATE):
            value = source.get(name)
            if isinstance(value, str) and name not in found:
                found[name] = value
    return found


def inject(headers: MutableMapping[str, Any]) -> None:
    """Put the current trace context in ``headers`` (``traceparent``; nothing without a valid
    current span or without the API)."""
    if not ENABLED or not trace.get_current_span().get_span_context().is_valid:
        return
    try:
        propagate.inject(headers)
    except Exception:  # tracing is a view, never a reason to fail
        logger.debug("could not inject the trace context", exc_info=True)


class AttemptTrace:
    """One attempt's span and what its transitions add to it (thread-safe: the renewal thread
    adds the lease-loss event). Made only when :func:`configured`."""

    __slots__ = ("outcome", "span")

    def __init__(self) -> None:
        self.span: Span | None = None
        self.outcome: str | None = None

    @contextlib.contextmanager
    def running(self, task_name: str, key: str, attempt_id: str, request: Any) -> Iterator[None]:
        """The attempt's span, current for the attempt (claim to the disposition carried out)."""
        try:
            span = _tracer().start_span(
                f"fence attempt {task_name}",
                context=_parent_context(message_headers(request)),
                kind=SpanKind.CONSUMER,
                attributes={"fence.key": key, "fence.attempt": attempt_id, "fence.task": task_name},
            )
        except Exception:
            logger.debug("could not start the attempt span", exc_info=True)
            yield
            return
        self.span = span
        try:
            # the disposition's exits (Celery's Retry, the body's error re-raised) say nothing
            # here: their messages can quote what the body sent; fence.outcome says what happened
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                yield
        finally:
            if self.outcome is not None:
                span.set_attribute("fence.outcome", self.outcome)
                if self.outcome in ("dead", "failed"):
                    span.set_status(Status(StatusCode.ERROR, self.outcome))
            span.end()

    def transition(self, action: Action, *, generation: int | None, reason: str | None) -> None:
        """What one announced transition adds: the generation, the outcome, an event."""
        span = self.span
        if span is None:
            return
        try:
            if generation is not None:
                span.set_attribute("fence.generation", generation)
            outcome = OUTCOMES.get(action)
            # a stale attempt whose message is re-sent to converge on the newer generation's
            # result stays stale: the re-send is the message's, the outcome the attempt's
            if outcome is not None and not (self.outcome == "stale" and outcome == "retry"):
                self.outcome = outcome
                span.set_attribute("fence.outcome", outcome)
            if action is Action.LOST:
                span.add_event("fence.lease_lost", _event(generation, reason))
            elif action is Action.STALE:  # a newer generation took the job over
                span.add_event("fence.takeover", _event(generation, reason))
        except Exception:  # tracing is a view, never a reason to fail
            logger.debug("could not add %s to the attempt span", action, exc_info=True)


def _event(generation: int | None, reason: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    if generation is not None:
        attributes["fence.generation"] = generation
    if reason:
        attributes["fence.reason"] = reason
    return attributes


def configured() -> bool:
    """Whether spans are recorded: the API is installed and the app set a TracerProvider (the
    API's default is a proxy to a no-op one)."""
    return ENABLED and not isinstance(trace.get_tracer_provider(), _NO_OP_PROVIDERS)


def attempt_trace() -> AttemptTrace | None:
    """A new attempt's trace, or None when tracing is off (the API is not installed, or no
    TracerProvider was set: then an attempt makes no span object at all)."""
    return AttemptTrace() if configured() else None


@contextlib.contextmanager
def child(name: str, attributes: Mapping[str, Any]) -> Iterator[Any]:
    """A span ``name`` under the current one (the attempt's); a failure marks it (the exception
    type only, or its ``error_type``, never its message: it can quote what the body wrote).
    Nothing without a valid current span or without the API."""
    if not ENABLED or not trace.get_current_span().get_span_context().is_valid:
        yield None
        return
    with _span(name, attributes=dict(attributes)) as span:
        yield span


@contextlib.contextmanager
def _span(name: str, **options: Any) -> Iterator[Any]:
    """A span ``name`` made current (``options``: ``start_as_current_span``'s); an exception
    marks it by :func:`_failed` alone (its message is never recorded)."""
    with _tracer().start_as_current_span(
        name, record_exception=False, set_status_on_exception=False, **options
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _failed(span, exc)
            raise


def _failed(span: Any, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``'s type (or its ``error_type``), never its message."""
    name = getattr(exc, "error_type", None) or type(exc).__name__
    span.set_status(Status(StatusCode.ERROR, name))
    span.set_attribute("error.type", name)


def fence_attributes(fence: Any) -> dict[str, Any]:
    """``fence.key``, ``fence.generation``, ``fence.attempt`` of a :class:`Fence`."""
    return {
        "fence.key": fence.key,
        "fence.generation": fence.generation,
        "fence.attempt": fence.attempt_id,
    }


def delivery(
    name: str, key: str, row_id: int, request: Any
) -> contextlib.AbstractContextManager[Any]:
    """The span of one outbox effect's delivery: in the trace the deliver task was sent in (the
    completing attempt's), else (a sweep) a trace of its own."""
    if not configured():
        return contextlib.nullcontext()
    return _delivery(name, key, row_id, request)


@contextlib.contextmanager
def _delivery(name: str, key: str, row_id: int, request: Any) -> Iterator[Any]:
    with _span(
        f"fence deliver {name}",
        context=_parent_context(message_headers(request)),
        kind=SpanKind.PRODUCER,
        attributes={"fence.key": key, "fence.outbox_id": row_id},
    ) as span:
        yield span


__all__ = [
    "ENABLED",
    "OUTCOMES",
    "TRACEPARENT",
    "TRACER_NAME",
    "AttemptTrace",
    "attempt_trace",
    "child",
    "configured",
    "delivery",
    "fence_attributes",
    "inject",
    "message_headers",
]
