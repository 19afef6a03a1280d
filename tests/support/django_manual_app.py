"""A Django project and its Celery app in one module, for ``celery -A`` subprocesses: its own
settings module (``DJANGO_SETTINGS_MODULE`` is this module), ``CELERY_FENCE_DATABASE =
"default"``, and ``DATABASES["default"]`` on the SQLite file ``FENCE_T_DJANGO_DB`` with
``AUTOCOMMIT`` from ``FENCE_T_DJANGO_AUTOCOMMIT`` ("0": off, which the fence refuses)."""

from __future__ import annotations

import os

from celery import Celery

from celery_fence import FencedTask

os.environ.setdefault("DJANGO_SETTINGS_MODULE", __name__)

SECRET_KEY = "test-only"
INSTALLED_APPS = ["django.contrib.contenttypes", "celery_fence.contrib.django"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("FENCE_T_DJANGO_DB", "django_manual.sqlite3"),
        "AUTOCOMMIT": os.environ.get("FENCE_T_DJANGO_AUTOCOMMIT", "1") != "0",
    }
}
USE_TZ = True
CELERY_BROKER_URL = os.environ.get("FENCE_TEST_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_FENCE_REDIS_URL = os.environ.get("FENCE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_FENCE_DATABASE = "default"

app = Celery("django_manual_app")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=FencedTask, bind=True, name="django_manual_app.bill")
def bill(self: FencedTask, n: int) -> int:
    with self.fence.atomic():
        return n
