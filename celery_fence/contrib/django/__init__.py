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
"""

from celery_fence.contrib.django.durable import enqueue

__all__ = ["enqueue"]
