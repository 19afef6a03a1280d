"""The port through which the core reaches the optional Django integration, so that the
dependency points down: the core asks this module, never :mod:`celery_fence.contrib.django`.

The integration registers its :class:`DjangoSide` when its package is imported
(``celery_fence/contrib/django/__init__.py``, which ``INSTALLED_APPS``, Django's app loading and
every import of one of its modules go through). The package ``celery_fence`` (its ``__init__``,
above ``contrib`` in the layers, run by Python before any module of the core) registers the
*loader* that imports the integration the first time the core needs it: a process with Django
configured gets its ORM writes guarded, ``fence.atomic()`` and the direct-call check whether or
not the app is in ``INSTALLED_APPS``. Neither path imports Django in a process that does not use
it: the core asks only when Django is configured, or for a Django feature it was told to use
(``fence.atomic()``, ``fence_database``).

Nothing here imports Django, nor the integration.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from celery_fence.errors import ConfigurationError


class DjangoSide(Protocol):
    """What the core asks of Django (:mod:`celery_fence.contrib.django` implements it)."""

    def url_for_alias(self, alias: str) -> str:
        """The store URL of ``DATABASES[alias]`` (``fence_database``), or a clear
        :class:`ConfigurationError`."""
        ...

    def atomic(self, fence: Any, using: str | None) -> AbstractContextManager[None]:
        """``fence.atomic(using)``: Django's ``transaction.atomic`` whose commit is fenced."""
        ...

    def watch_writes(self) -> None:
        """Watch every Django ORM write of this process (once per process)."""
        ...

    def atomic_aliases_on(self, store_url: str) -> list[str]:
        """The aliases on the store's database with an ``atomic()`` block open in this thread."""
        ...


_side: DjangoSide | None = None
_loader: Callable[[], object] | None = None


def register(side: DjangoSide) -> None:
    """The integration's registration (its package ``__init__``): the one implementation."""
    global _side
    _side = side


def register_loader(loader: Callable[[], object]) -> None:
    """How to load the integration when the core first needs it (``celery_fence``'s
    ``__init__``): a callable that imports it, and so makes it :func:`register`."""
    global _loader
    _loader = loader


def django_side(needed_by: str) -> DjangoSide:
    """The registered integration, loaded on first need (an :class:`ImportError` when Django
    cannot be imported: the caller names what to install). None registered and no loader: a
    :class:`ConfigurationError` naming ``needed_by`` and the fix, never a silent skip."""
    if _side is None and _loader is not None:
        _loader()
    if _side is None:
        raise ConfigurationError(
            f"{needed_by} needs celery-fence's Django integration, which is not loaded in this "
            "process: add 'celery_fence.contrib.django' to INSTALLED_APPS, or import "
            "celery_fence.contrib.django before the Celery app runs its tasks."
        )
    return _side


def django_configured() -> bool:
    """Whether this process has Django imported and its settings configured (Django is never
    imported here: a process that did not import it is not a Django process)."""
    conf = sys.modules.get("django.conf")
    try:
        return conf is not None and "django.db" in sys.modules and bool(conf.settings.configured)
    except Exception:  # settings that cannot be read: nothing of Django's to ask about
        return False


__all__ = ["DjangoSide", "django_configured", "django_side", "register", "register_loader"]
