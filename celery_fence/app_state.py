"""Per-app state: what celery-fence keeps on a Celery app, made in the parent before the pool
forks and shared by the children (per-process objects live on
:class:`~celery_fence.process.runtime.Runtime`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_fence.config import FenceConfig
    from celery_fence.ops.outbox import Outbox


@dataclass
class AppState:
    """The celery-fence state of one app."""

    #: The app's settings (:meth:`FenceConfig.from_app`); None until first read.
    config: FenceConfig | None = None
    #: The app's :class:`~celery_fence.ops.outbox.Outbox` (its handler registry), if one was made.
    outbox: Outbox | None = None
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


__all__ = ["AppState", "app_state", "installed", "installed_apps", "mark_installed", "real_app"]
