"""Real Celery worker processes for acceptance tests: the harness's one worker class
(:class:`celery_fence.testing.processes.Worker`), running the test apps from the repository root."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from celery_fence.testing.processes import Worker, running, wait_until

ROOT = Path(__file__).resolve().parents[2]


def app_worker(app: str, **options: Any) -> Worker:
    """A (not started) worker of one of the test apps (``tests.support.app``, ...), which it
    imports from :data:`ROOT` wherever pytest was started; ``options`` as :class:`Worker` takes
    them."""
    options.setdefault("cwd", ROOT)
    options.setdefault("pythonpath", [str(ROOT)])
    return Worker(app, **options)


class SpawnWorker(Protocol):
    """The ``spawn_worker`` fixture: start a worker of ``tests.support.app`` named ``name`` (stopped
    after the test). Keywords: ``concurrency`` (int), ``pool``, ``loglevel`` (str), ``extra_args``
    (tuple of str); any other is an environment override (``FENCE_T_*``: str)."""

    def __call__(self, name: str = ..., **options: Any) -> Worker: ...


__all__ = ["ROOT", "SpawnWorker", "Worker", "app_worker", "running", "wait_until"]
