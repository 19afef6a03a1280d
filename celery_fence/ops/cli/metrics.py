"""``celery -A proj fence metrics``: the store gauges (:mod:`celery_fence.metrics.store`), printed
once in Prometheus's text format, or served (``--serve``) on ``--port`` for Prometheus to scrape.
Run one of these per store: workers do not read the store for metrics."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click
from celery.bin.base import CeleryOption

from celery_fence import metrics
from celery_fence.ops.cli.common import EX_USAGE, FenceCLIError, command
from celery_fence.ops.metrics import StoreCollector

#: The port ``fence metrics --serve`` listens on when neither ``--port`` nor
#: ``fence_metrics_port`` says one (a worker on the same host takes ``fence_metrics_port``).
DEFAULT_PORT = 9809


def _registry(app: Any) -> Any:
    if not metrics.available():
        raise FenceCLIError(f"fence metrics needs prometheus_client: {metrics.INSTALL_HINT}")
    from prometheus_client import CollectorRegistry

    app.loader.import_default_modules()
    registry = CollectorRegistry()
    registry.register(StoreCollector(app))
    return registry


@command("metrics")
@click.option(
    "--serve",
    is_flag=True,
    cls=CeleryOption,
    help_group="Metrics Options",
    help="Serve /metrics until interrupted, instead of printing the gauges once.",
)
@click.option(
    "--port",
    cls=CeleryOption,
    type=click.IntRange(1, 65535),
    default=None,
    help_group="Metrics Options",
    help=f"Port to serve on (default {DEFAULT_PORT}).",
)
@click.option(
    "--bind",
    cls=CeleryOption,
    default="0.0.0.0",
    show_default=True,
    help_group="Metrics Options",
    help="Address to serve on.",
)
@click.pass_context
def metrics_command(ctx: click.Context, serve: bool, port: int | None, bind: str) -> None:
    """The store's gauges (jobs by status, stuck jobs, outbox): printed once in Prometheus's text
    format, or with --serve kept on http://BIND:PORT/metrics for Prometheus to scrape."""
    if port is not None and not serve:
        raise FenceCLIError("--port goes with --serve", exit_code=EX_USAGE)
    registry = _registry(ctx.obj.app)
    from prometheus_client import generate_latest, start_http_server

    if not serve:
        ctx.obj.echo(generate_latest(registry).decode().rstrip("\n"))
        return
    port = port or DEFAULT_PORT
    try:
        server, thread = start_http_server(port, addr=bind, registry=registry)
    except OSError as exc:
        raise FenceCLIError(
            f"cannot serve on {bind}:{port} ({exc}): choose a free --port"
        ) from None
    ctx.obj.echo(f"serving celery-fence store metrics on http://{bind}:{port}/metrics")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


__all__ = ["DEFAULT_PORT", "metrics_command"]
