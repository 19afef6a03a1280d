"""Per-app state: what celery-fence keeps on a Celery app, made in the parent before the pool
forks and shared by the children (per-process objects live on
:class:`~celery_fence.process.runtime.Runtime`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class AppState:
    """The celery-fence state of one app."""

    #: The values the layers above keep on the app, each through its own typed :class:`AppSlot`
    #: (the settings, the outbox's handler registry).
    slots: dict[str, Any] = field(default_factory=dict)
    #: Whether the worker sends task events (``-E`` sets the worker's flag, not ``app.conf``);
    #: None until ``worker_init`` says (see
    # :func:`celery_fence.announce.events.task_events_enabled`).
    task_events: bool | None = None
    #: What the worker was started with, as an operator types it again: ``celery -A proj``;
    #: None until ``worker_init`` says (see :func:`celery_fence.adapters.worker.celery_command`).
    celery_command: str | None = None
    #: Whether :func:`celery_fence.install` ran for the app (its receivers act on it).
    installed: bool = False


_STATE_ATTRIBUTE = "_fence_state"

#: The apps :func:`celery_fence.install` ran for in this process (inherited by a forked child).
_installed_apps: weakref.WeakSet[Any] = weakref.WeakSet()


def app_state(app: Any) -> AppState:
    """The celery-fence state of ``app`` (kept on the app: it lives and dies with it)."""
    state: AppState | None = app.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        state = app.__dict__.setdefault(_STATE_ATTRIBUTE, AppState())
    return state


class AppSlot(Generic[T]):
    """One value of type ``T`` a layer above this one keeps on each app, typed where it is
    declared: ``FenceConfig.from_app``'s settings (:mod:`celery_fence.config`), the app's
    ``Outbox`` (:mod:`celery_fence.ops.outbox`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get(self, app: Any) -> T | None:
        """The app's value; None until one is set."""
        value: T | None = app_state(app).slots.get(self.name)
        return value

    def set(self, app: Any, value: T | None) -> None:
        """Set (None: forget) the app's value."""
        app_state(app).slots[self.name] = value


def real_app(app: Any) -> Any:
    """``app`` itself, or the app behind Celery's ``current_app`` proxy."""
    resolve = getattr(app, "_get_current_object", None)
    return resolve() if callable(resolve) else app


def mark_installed(app: Any) -> bool:
    """Record that ``app`` is installed; False when it already was (idempotent)."""
    state = app_state(app)
    if state.installed:
        return False
    state.installed = True
    _installed_apps.add(app)
    return True


def installed(app: Any) -> bool:
    """Whether ``app`` (a Celery app, a proxy to one, or None) was installed; never creates
    state on an app that was not: the receivers ask this of every app a signal names."""
    if app is None:
        return False
    state = getattr(real_app(app), "__dict__", {}).get(_STATE_ATTRIBUTE)
    return isinstance(state, AppState) and state.installed


def installed_apps() -> list[Any]:
    """The apps installed in this process (in no particular order)."""
    return list(_installed_apps)


__all__ = [
    "AppSlot",
    "AppState",
    "app_state",
    "installed",
    "installed_apps",
    "mark_installed",
    "real_app",
]
