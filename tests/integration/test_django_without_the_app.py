"""The core reaches the Django integration through a port (``celery_fence.django_port``), never by
importing it; a Django project that leaves ``celery_fence.contrib.django`` out of
``INSTALLED_APPS`` and never imports it still gets its Django writes guarded, ``fence.atomic()``
and the direct-call check (the package's ``__init__`` loads the integration the first time the
core needs it), and a process where it cannot be loaded is told so, never left unguarded.

Each case is a fresh interpreter (a real settings module, a real SQLite database, the shared
Redis), so that nothing imported the integration before the core needed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_fence import django_port
from celery_fence.errors import ConfigurationError
from tests.support.env import BROKER_URL, REDIS_URL
from tests.support.worker import ROOT

SETTINGS = """
SECRET_KEY = "test"
INSTALLED_APPS = ["django.contrib.contenttypes"]  # not celery_fence.contrib.django
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {db!r}}}}}
USE_TZ = True
"""

PROJECT = """
import json
import os
import sys

import django

django.setup()
import sqlalchemy as sa  # noqa: E402
from celery import Celery  # noqa: E402
from django.db import connection, transaction  # noqa: E402

import celery_fence  # noqa: E402
from celery_fence import FencedTask, get_store  # noqa: E402

DB = os.environ["PROJ_DB"]
URL = f"sqlite:///{DB}"  # the store in Django's own database, named by URL (no port needed)
engine = sa.create_engine(URL)
celery_fence.metadata.create_all(engine)
with engine.begin() as conn:
    conn.exec_driver_sql("CREATE TABLE rows (generation int)")
engine.dispose()

app = Celery("noapp", broker=os.environ["PROJ_BROKER"])
app.conf.update(
    fence_redis_url=os.environ["PROJ_REDIS"], fence_database_url=URL, fence_unfenced_writes="error"
)
RUN = os.environ["PROJ_RUN"]


def insert(generation):
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO rows (generation) VALUES (%s)", [generation])


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"{RUN}:plain:{n}")
def plain(self, n):
    insert(self.fence.generation)  # outside every fenced block
    return n


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"{RUN}:block:{n}")
def block(self, n):
    with self.fence.atomic():
        insert(self.fence.generation)
    return n


def rows():
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM rows")
        return cursor.fetchone()[0]


def attempt(fn):
    try:
        return {"value": fn()}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


out = {"loaded_first": "celery_fence.contrib.django" in sys.modules}
out["plain"] = attempt(lambda: plain(1))  # the first fenced call: Django's writes watched
out["rows_after_plain"] = rows()
out["loaded_then"] = "celery_fence.contrib.django" in sys.modules
out["block"] = attempt(lambda: block(2))
out["block_status"] = get_store(app).get(f"{RUN}:block:2").status
out["rows_after_block"] = rows()
with transaction.atomic():
    out["inside_atomic"] = attempt(lambda: block(3))
print(json.dumps(out))
"""


def _run(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "noapp_settings.py").write_text(SETTINGS.format(db=str(tmp_path / "app.sqlite3")))
    (tmp_path / "noapp.py").write_text(script)
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "noapp_settings",
        "PROJ_DB": str(tmp_path / "app.sqlite3"),
        "PROJ_BROKER": BROKER_URL,
        "PROJ_REDIS": REDIS_URL,
        "PROJ_RUN": f"noapp-{uuid.uuid4().hex[:8]}",
        **env,
    }
    return subprocess.run(
        [sys.executable, str(tmp_path / "noapp.py")],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_project_without_the_app_keeps_the_guard_the_atomic_block_and_the_direct_check(
    tmp_path: Path,
) -> None:
    # Given a Django project whose INSTALLED_APPS leaves the integration out, and that never
    # imports it, calling fenced tasks directly (fence_unfenced_writes="error")
    done = _run(tmp_path, PROJECT)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # Then nothing had imported the integration before the first fenced call ...
    assert out["loaded_first"] is False
    # ... whose Django write outside every block is refused and rolled back (the guard is on),
    assert out["plain"]["error"] == "ConfigurationError", out["plain"]
    assert "outside any fenced block" in out["plain"]["message"]
    assert out["rows_after_plain"] == 0
    assert out["loaded_then"] is True
    # fence.atomic() commits its write under the fence and the job completes,
    assert out["block"] == {"value": 2}
    assert out["block_status"] == "completed"
    assert out["rows_after_block"] == 1
    # and a direct call inside Django's own atomic() on the store's database is refused
    assert out["inside_atomic"]["error"] == "FenceError", out["inside_atomic"]
    assert "transaction.atomic() is open on alias 'default'" in out["inside_atomic"]["message"]


def test_fence_database_without_django_importable_names_the_extra_to_install(
    tmp_path: Path,
) -> None:
    # Given a process where Django cannot be imported, and settings naming a Django alias
    script = (
        "import os, sys\n"
        "os.environ.pop('DJANGO_SETTINGS_MODULE')  # no Django project either\n"
        "sys.modules['django.conf'] = None  # as without the django extra\n"
        "from celery import Celery\n"
        "from celery_fence import FenceConfig\n"
        "app = Celery('nodjango')\n"
        "app.conf.update(fence_database='default')\n"
        "try:\n"
        "    FenceConfig.from_app(app)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = _run(tmp_path, script)
    assert done.returncode == 0, done.stderr[-3000:]
    # Then the error says Django is missing and what to do: the extra, or a URL
    assert done.stdout.startswith("ConfigurationError fence_database='default' names a Django"), (
        done.stdout
    )
    assert "Django cannot be imported" in done.stdout
    assert "install celery-fence[django], or set fence_database_url instead" in done.stdout


def test_with_no_integration_registered_and_no_loader_the_core_refuses_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a process where nothing registered the Django side nor the loader of it
    monkeypatch.setattr(django_port, "_side", None)
    monkeypatch.setattr(django_port, "_loader", None)
    # Then what needs it refuses, naming what needed it and both fixes, instead of skipping
    with pytest.raises(ConfigurationError) as refused:
        django_port.django_side("self.fence.atomic()")
    message = str(refused.value)
    assert message.startswith("self.fence.atomic() needs celery-fence's Django integration")
    assert "add 'celery_fence.contrib.django' to INSTALLED_APPS" in message
    assert "import celery_fence.contrib.django" in message
