"""The acceptance tests' app (:mod:`tests.support.app`, same settings and ledger) with the tasks
of Celery's own semantics on fenced tasks: Flask's base task pattern (a subclass ``__call__``),
``max_retries``, immediate retries, and plain Celery twins to compare with.

Ledger as in ``app.py``: ``<prefix>:runs:<key>`` one entry per body start,
``<prefix>:effects:<key>`` one per side effect performed (``"<generation>:<attempt id>"``;
``"plain"`` for the unfenced twins).
"""

from __future__ import annotations

import time
from typing import Any

from flask import Flask, current_app

from celery_fence import FencedTask
from tests.support.app import PREFIX, app, ledger

__all__ = ["app"]

flask_app = Flask("fence_semantics")


def _sleep(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)


class FlaskTask(FencedTask, fence_base=True):
    """Flask's documented base task: ``__call__`` runs ``self.run`` inside the app context."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with flask_app.app_context():
            return self.run(*args, **kwargs)


class FlaskSuperTask(FencedTask, fence_base=True):
    """The same pattern through ``super().__call__`` (it must not fence twice)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with flask_app.app_context():
            return super().__call__(*args, **kwargs)


def _flask_body(task: Any, key: str, sleep: float) -> dict[str, Any]:
    fence = task.fence
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{fence.generation}:{fence.attempt_id}")
    _sleep(sleep)
    with fence.guard():
        ledger.rpush(f"{PREFIX}:effects:{key}", f"{fence.generation}:{fence.attempt_id}")
    return {"key": key, "generation": fence.generation, "app": current_app.name}


@app.task(shared=False, base=FlaskTask, bind=True, fence_key=lambda key, **kw: key)
def flask_work(self: Any, key: str, *, sleep: float = 0.0) -> dict[str, Any]:
    return _flask_body(self, key, sleep)


@app.task(shared=False, base=FlaskSuperTask, bind=True, fence_key=lambda key, **kw: key)
def flask_super_work(self: Any, key: str, *, sleep: float = 0.0) -> dict[str, Any]:
    return _flask_body(self, key, sleep)


# -- max_retries ----------------------------------------------------------------------------------
@app.task(shared=False, base=FencedTask, bind=True, max_retries=1, fence_key=lambda key, **kw: key)
def limited(self: Any, key: str, *, sleep: float = 0.0) -> dict[str, Any]:
    """``max_retries=1``; the fence's own re-sends (a busy lease) must not spend it."""
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    _sleep(sleep)
    return {"key": key, "generation": self.fence.generation}


def _always_retry(task: Any, key: str, run: str, with_exc: bool) -> None:
    ledger.rpush(f"{PREFIX}:runs:{key}", run)
    if with_exc:
        raise task.retry(exc=ValueError("the body's own error"), countdown=0)
    raise task.retry(countdown=0)


@app.task(shared=False, base=FencedTask, bind=True, max_retries=2, fence_key=lambda key, **kw: key)
def retry_always(self: Any, key: str, *, with_exc: bool = False) -> None:
    _always_retry(self, key, f"{self.fence.generation}:{self.fence.attempt_id}", with_exc)


@app.task(shared=False, bind=True, max_retries=2)
def plain_retry_always(self: Any, key: str, *, with_exc: bool = False) -> None:
    _always_retry(self, key, "plain", with_exc)


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    max_retries=2,
    autoretry_for=(ValueError,),
    retry_backoff=False,
    default_retry_delay=0,
    fence_key=lambda key, **kw: key,
)
def autoretry_always(self: Any, key: str) -> None:
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    raise ValueError("the body's own error")


@app.task(
    shared=False,
    bind=True,
    max_retries=2,
    autoretry_for=(ValueError,),
    retry_backoff=False,
    default_retry_delay=0,
)
def plain_autoretry_always(self: Any, key: str) -> None:
    ledger.rpush(f"{PREFIX}:runs:{key}", "plain")
    raise ValueError("the body's own error")


# -- an immediate retry under a long lease ---------------------------------------------------------
@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    lease_ttl=30.0,
    renew_interval=1.0,
    fence_key=lambda key, **kw: key,
)
def retry_now_once(self: Any, key: str) -> dict[str, Any]:
    """``self.retry(countdown=0)`` on its first run, under a 30 s lease."""
    runs = ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    if runs == 1:
        raise self.retry(countdown=0)
    return {"key": key, "runs": runs}


# -- results ------------------------------------------------------------------------------------
@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def non_json_shaped(self: Any, key: str, *, sleep: float = 0.0) -> dict[Any, Any]:
    """Returns a value JSON changes: an int key, a tuple."""
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{self.fence.generation}:{self.fence.attempt_id}")
    _sleep(sleep)
    return {1: "a", "t": (1, 2)}


# The results travel pickled, so a caller sees what the task returned, not what JSON made of it:
# the JSON round trip, where it happens, is the fence's.
app.conf.result_serializer = "pickle"
app.conf.result_accept_content = ["json", "pickle"]
