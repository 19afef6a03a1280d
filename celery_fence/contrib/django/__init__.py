"""celery-fence in a Django project.

- ``INSTALLED_APPS += ["celery_fence.contrib.django"]``: the fence tables through
  ``manage.py migrate``, system checks of the fence settings, a read-only admin of the jobs.
- ``CELERY_FENCE_DATABASE = "default"``: the store is built from ``DATABASES["default"]``
  (:mod:`.database`); an explicit ``CELERY_FENCE_DATABASE_URL`` still wins.
- ``with self.fence.atomic():``: Django's ``transaction.atomic`` whose commit is fenced
  (:mod:`.atomic`).
- ``celery_fence.contrib.django.enqueue(task, args=...)`` inside ``transaction.atomic()``: the
  job's row in your transaction, its message sent on commit (:mod:`.durable`).

Nothing here is imported unless Django is used: ``celery_fence`` itself never imports Django.
Importing this package registers what the core asks of Django (:mod:`celery_fence.django_port`):
the core never imports it; ``celery_fence``'s ``__init__`` imports it the first time the core
needs it, in a process with Django configured.
"""

from celery_fence import django_port
from celery_fence.contrib.django import atomic as _atomic
from celery_fence.contrib.django import database as _database
from celery_fence.contrib.django import guard as _guard
from celery_fence.contrib.django.durable import enqueue


class _DjangoSide:
    """The one :class:`~celery_fence.django_port.DjangoSide`: this package's functions."""

    url_for_alias = staticmethod(_database.url_for_alias)
    atomic = staticmethod(_atomic.atomic)
    watch_writes = staticmethod(_guard.install)
    atomic_aliases_on = staticmethod(_database.atomic_aliases_on)


django_port.register(_DjangoSide())

__all__ = ["enqueue"]
