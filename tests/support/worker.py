"""Real Celery worker processes for acceptance tests: the project's one process module
(:mod:`celery_fence.testing.processes`), with workers run from the repository root."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from celery_fence.testing import processes
from celery_fence.testing.processes import running, wait_until

ROOT = Path(__file__).resolve().parents[2]


class Worker(processes.Worker):
    """A worker of one of the test apps (``tests.support.app``, ...), importable from ROOT."""

    def __init__(self, app: str, **kwargs: Any) -> None:
        kwargs.setdefault("cwd", ROOT)
        kwargs.setdefault("pythonpath", [str(ROOT)])
        super().__init__(app, **kwargs)


class SpawnWorker(Protocol):
    """The ``spawn_worker`` fixture: start a worker of ``tests.support.app`` named ``name`` (stopped
    after the test). Keywords: ``concurrency`` (int), ``pool``, ``loglevel`` (str), ``extra_args``
    (tuple of str); any other is an environment override (``FENCE_T_*``: str)."""

    def __call__(self, name: str = ..., **options: Any) -> Worker: ...


__all__ = ["ROOT", "SpawnWorker", "Worker", "running", "wait_until"]
