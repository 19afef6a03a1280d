"""Settings of the billing example.

``BILLING_DATABASE=sqlite`` runs it on SQLite files instead of PostgreSQL (127.0.0.1:5432, user
``postgres``; ``BILLING_DB_NAME`` names the development database).
"""

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "django-insecure-example-only"
DEBUG = True
ALLOWED_HOSTS: list[str] = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",  # the admin's CSS under runserver
    "celery_fence.contrib.django",  # the fence tables (migrate), checks, admin
    "billing",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "billing_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

if os.environ.get("BILLING_DATABASE", "postgresql") == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("BILLING_DB_NAME", str(BASE_DIR / "billing.sqlite3")),
            # workers in other processes share the test database: a file, not memory
            "TEST": {"NAME": str(BASE_DIR / f"test_billing_{os.getpid()}.sqlite3")},
        }
    }
    if django.VERSION >= (5, 1):  # take the write lock at BEGIN, as the fence store does
        DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("BILLING_DB_NAME", "billing"),
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
            "TEST": {"NAME": f"test_billing_{os.getpid()}"},
        }
    }
#: The development database's name, as configured (pytest-django renames DATABASES' NAME to
#: the test database's): the example's tests open it to show the workers never touch it.
BILLING_DEVELOPMENT_DATABASE = DATABASES["default"]["NAME"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

CELERY_BROKER_URL = os.environ.get("BILLING_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("BILLING_RESULT_BACKEND", "redis://127.0.0.1:6379/0")
CELERY_FENCE_REDIS_URL = os.environ.get("BILLING_FENCE_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_FENCE_DATABASE = "default"  # the fence store lives in DATABASES["default"]
