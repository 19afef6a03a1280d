"""The Celery app, configured the standard Django way: every ``CELERY_*`` setting of
``settings.py`` (``CELERY_FENCE_DATABASE`` included), tasks found in each app's ``tasks.py``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_project.settings")

app = Celery("billing_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
