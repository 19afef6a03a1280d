"""Spans of real worker processes, for the trace tests.

A worker app calls :func:`export_to_file` when ``FENCE_T_SPANS`` names a file: its spans are
written there as JSON lines, one per span as it ends (a :class:`JsonLinesExporter` behind a
simple processor: a span ended before a SIGKILL is on disk). The test process reads them with
:func:`read_spans` and keeps its own spans (the request span around ``enqueue()``) in an
``InMemorySpanExporter`` (:func:`test_exporter`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

#: The environment variable naming a worker's span file.
SPANS_ENV = "FENCE_T_SPANS"


class JsonLinesExporter(SpanExporter):
    """Appends each span to a file as one JSON line (opened per batch in append mode: forked
    pool processes share the file safely, one ``write`` per line)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(_as_dict(span)) + "\n" for span in spans)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _as_dict(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": event.name, "attributes": dict(event.attributes or {})}
            for event in span.events
        ],
        "status": span.status.status_code.name,
        "pid": os.getpid(),
    }


def export_to_file(path: str) -> None:
    """This process's global TracerProvider writes every span to ``path``."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)


@dataclass(frozen=True)
class SpanRecord:
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    status: str
    pid: int


def read_spans(path: Path) -> list[SpanRecord]:
    """The spans the workers wrote to ``path`` so far."""
    if not path.exists():
        return []
    return [
        SpanRecord(**json.loads(line))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


_TEST_EXPORTER: InMemorySpanExporter | None = None


def process_exporter() -> InMemorySpanExporter:
    """The test process's in-memory exporter, behind its global TracerProvider (set once)."""
    global _TEST_EXPORTER
    if _TEST_EXPORTER is None:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is not provider:
            raise RuntimeError("another global TracerProvider was set in this test process first")
        _TEST_EXPORTER = exporter
    return _TEST_EXPORTER


def trace_id_of(span: Any) -> str:
    """The trace id of a live span of this process, as :class:`SpanRecord` writes it."""
    return f"{span.get_span_context().trace_id:032x}"
