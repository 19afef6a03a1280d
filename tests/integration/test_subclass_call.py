"""A ``FencedTask`` subclass with its own ``__call__`` (Flask's documented app-context base task,
a mixin's) runs as the fenced body; one assigned to a task's class after the class was made is
refused when the task is bound. In-process direct calls on a real store and Redis (the worker
path is in ``tests/acceptance/test_celery_semantics.py``)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_fence import ConfigurationError, FencedTask
from celery_fence.store import Store
from tests.support.env import REDIS_URL

#: Whether the app-context-like context manager is entered (what Flask's app_context() gives).
CONTEXT: list[str] = []


@contextlib.contextmanager
def app_context() -> Iterator[None]:
    CONTEXT.append("app")
    try:
        yield
    finally:
        CONTEXT.pop()


class ContextTask(FencedTask, fence_base=True):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with app_context():
            return self.run(*args, **kwargs)


class ContextMixin:
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with app_context():
            return super().__call__(*args, **kwargs)  # type: ignore[misc]


class MixinTask(ContextMixin, FencedTask, fence_base=True):
    pass


@pytest.fixture
def app(store: Store, prefix: str) -> Iterator[Celery]:
    app = Celery(f"subclass-{prefix}", set_as_current=False)
    app.conf.update(
        fence_database_url=store.url, fence_redis_url=REDIS_URL, fence_key_prefix=prefix
    )
    yield app
    app.close()


@pytest.mark.parametrize("base", [ContextTask, MixinTask], ids=["own-call", "mixin-call"])
def test_a_subclass_call_runs_the_body_fenced(app: Celery, store: Store, base: type) -> None:
    seen: list[tuple[int, list[str]]] = []

    @app.task(base=base, bind=True, fence_key=lambda key: key, name=f"t.ctx.{base.__name__}")
    def ctx(self: Any, key: str) -> dict[str, Any]:
        seen.append((self.fence.generation, list(CONTEXT)))  # self.fence works in the context
        return {"key": key}

    key = f"ctx:{uuid.uuid4().hex[:8]}"
    assert ctx(key) == {"key": key}
    assert ctx(key) == {"key": key}  # a repeat replays: the body ran once
    assert seen == [(1, ["app"])]
    record = store.get(key)
    assert record is not None and (record.status, record.attempts) == ("completed", 1)
    assert [t.action for t in store.transitions.history(key)] == ["claimed", "completed"]


def test_a_call_assigned_after_the_class_was_made_is_refused_when_bound(app: Celery) -> None:
    class Late(FencedTask):
        name = "t.late"
        fence_key = staticmethod(lambda key: key)

        def run(self, key: str) -> str:
            return key

    def unfenced_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    Late.__call__ = unfenced_call  # type: ignore[method-assign]
    with pytest.raises(ConfigurationError, match=r"t\.late: its __call__ was replaced"):
        app.register_task(Late())


def test_a_base_whose_call_was_assigned_late_still_runs_fenced(app: Celery, store: Store) -> None:
    class LateBase(FencedTask, fence_base=True):
        pass

    def call_in_context(self: Any, *args: Any, **kwargs: Any) -> Any:
        with app_context():
            return self.run(*args, **kwargs)

    LateBase.__call__ = call_in_context  # type: ignore[method-assign]

    @app.task(base=LateBase, bind=True, fence_key=lambda key: key, name="t.late_base")
    def late_base(self: Any, key: str) -> tuple[int, list[str]]:
        return (self.fence.generation, list(CONTEXT))

    key = f"late:{uuid.uuid4().hex[:8]}"
    assert late_base(key) == [1, ["app"]]  # the task's own class wraps the inherited __call__
    record = store.get(key)
    assert record is not None and record.status == "completed"
