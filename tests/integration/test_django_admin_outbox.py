"""The Django admin lists the outbox's effects read-only, without payloads, searchable by job key.

A real Django project (written to a temporary directory, run as a subprocess) on SQLite and on a
PostgreSQL database of its own: ``migrate``, rows written by the store's own completion, then the
admin's pages fetched through Django's test client as a logged-in superuser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.env import BROKER_URL, PG_ADMIN_URL, REDIS_URL
from tests.support.worker import ROOT

SETTINGS = """
SECRET_KEY = "test"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_fence.contrib.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {{"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]}},
}}]
ROOT_URLCONF = "proj.urls"
DATABASES = {{"default": {database}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
CELERY_BROKER_URL = {broker!r}
CELERY_FENCE_REDIS_URL = {redis!r}
CELERY_FENCE_DATABASE = "default"
"""

URLS = """
from django.contrib import admin
from django.urls import path
urlpatterns = [path("admin/", admin.site.urls)]
"""

SCRIPT = """
import json, sys, django
django.setup()
from django.core.management import call_command
from django.contrib.auth.models import User
from django.test import Client
from celery_fence.contrib.django.settings import fence_config
from celery_fence.store import Effect, Store
from celery_fence.store.records import Completion

call_command("migrate", verbosity=0)
call_command("makemigrations", "celery_fence", check=True, dry_run=True, verbosity=0)
store = Store(fence_config().database_url)
secret, key, other = sys.argv[1:4]
for k in (key, other):
    store.register(k, generation=1, attempt_id="A", task_name="t")
    effects = [Effect(n, {"card": secret}, f"{k}:{n}") for n in ("mail", "sms")]
    store.end(k, Completion(generation=1, attempt_id="A", result=None, effects=effects))
row = [r for r in store.outbox_rows.claim(claimer="t", claim_ttl=30, limit=5, key=key)
       if r.name == "sms"][0]
store.outbox_rows.fail(row.id, claimer="t", error=ConnectionError("provider down"))
User.objects.create_superuser("op", "op@example.com", "pw")
client = Client()
client.force_login(User.objects.get(username="op"))
base = "/admin/celery_fence/outboxeffect/"
listing = client.get(base, {"q": key})
change = client.get(f"{base}{row.id}/change/")
add = client.get(f"{base}add/")
print(json.dumps({
    "list_status": listing.status_code,
    "list": listing.content.decode(),
    "change_status": change.status_code,
    "change": change.content.decode(),
    "add_status": add.status_code,
    "sms_id": row.id,
}))
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def django_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The ``DATABASES["default"]`` entry of the project: a SQLite file or a fresh PostgreSQL
    database of this test's own (Django's tables go in it too)."""
    if request.param == "sqlite":
        yield repr({"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "app.sqlite3")})
        return
    name = f"celery_fence_admin_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL)
    yield repr(
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": url.username,
            "HOST": url.host,
            "PORT": url.port or 5432,
        }
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def test_the_admin_lists_outbox_effects_read_only_without_payloads(
    tmp_path: Path, django_database: str
) -> None:
    package = tmp_path / "proj"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "settings.py").write_text(
        SETTINGS.format(database=django_database, broker=BROKER_URL, redis=REDIS_URL)
    )
    (package / "urls.py").write_text(URLS)
    (tmp_path / "script.py").write_text(SCRIPT)
    secret = f"4111-{uuid.uuid4().hex}"
    key, other = f"job:{uuid.uuid4().hex[:8]}", f"job:{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "proj.settings"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "script.py", secret, key, other],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])

    # The list: this key's two effects (searched by key), their state and last error; no payload.
    assert doc["list_status"] == 200
    listing = doc["list"]
    assert secret not in listing and "card" not in listing and "payload" not in listing.lower()
    assert listing.count(key) >= 2 and other not in listing
    assert "ConnectionError: provider down" in listing
    assert "dead" in listing and "pending" in listing
    # One effect's page: read-only fields, the idempotency key, no payload.
    assert doc["change_status"] == 200
    change = doc["change"]
    assert f"{key}:sms" in change and secret not in change and "payload" not in change.lower()
    assert 'name="_save"' not in change  # read-only: no save button
    # No adding (nor changing or deleting) rows through the admin.
    assert doc["add_status"] == 403
