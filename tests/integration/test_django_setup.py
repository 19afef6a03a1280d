"""A new Django project's set-up, as ``manage.py check`` and ``celery fence check`` see it (each a
real subprocess on a project written to a temporary directory): the store must be named
(``CELERY_FENCE_DATABASE``), a short ``CELERY_FENCE_LEASE_TTL`` alone is enough (the renew
interval follows it), and errors name settings as the project spells them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.env import BROKER_URL, REDIS_URL
from tests.support.worker import ROOT

SETTINGS = """
import os
SECRET_KEY = "test"
INSTALLED_APPS = ["django.contrib.contenttypes", "celery_fence.contrib.django"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {db!r}}}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
CELERY_BROKER_URL = {broker!r}
CELERY_FENCE_REDIS_URL = {redis!r}
for _name, _value in os.environ.items():  # the test's CELERY_FENCE_* settings
    if _name.startswith("T_CELERY_FENCE_"):
        globals()[_name[2:]] = float(_value) if _value[0].isdigit() else _value
"""

CELERY = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
from celery import Celery
from celery_fence import FencedTask
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")

@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"n:{n}")
def double(self, n):
    return 2 * n
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A Django project ``proj`` (settings, a Celery app with one fenced task) in ``tmp_path``."""
    package = tmp_path / "proj"
    package.mkdir()
    (package / "__init__.py").write_text("")
    db = str(tmp_path / "app.sqlite3")
    (package / "settings.py").write_text(SETTINGS.format(db=db, broker=BROKER_URL, redis=REDIS_URL))
    (package / "celery.py").write_text(CELERY)
    return tmp_path


def _run(project: Path, args: list[str], **settings: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("T_CELERY_FENCE_")}
    env.update({f"T_{name}": value for name, value in settings.items()})
    env.update(PYTHONPATH=os.pathsep.join([str(project), str(ROOT)]))
    env["DJANGO_SETTINGS_MODULE"] = "proj.settings"
    return subprocess.run(
        [sys.executable, *args], cwd=project, env=env, capture_output=True, text=True, timeout=120
    )


def _manage_check(project: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    return _run(project, ["-m", "django", "check"], **settings)


def _fence_check(project: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    return _run(project, ["-m", "celery", "-A", "proj.celery:app", "fence", "check"], **settings)


def test_a_project_that_names_no_store_fails_both_checks_and_makes_no_file(
    project: Path,
) -> None:
    # Given a Django project with the fence app installed but no CELERY_FENCE_DATABASE,
    # then manage.py check fails with an error naming the setting (not a warning),
    checked = _manage_check(project)
    assert checked.returncode != 0, checked.stdout + checked.stderr
    assert "celery_fence.E002" in checked.stderr and "CELERY_FENCE_DATABASE" in checked.stderr
    # celery fence check says the same in one line (not "run init-db"),
    fenced = _fence_check(project)
    lines = [line for line in fenced.stderr.splitlines() if line.strip()]
    assert fenced.returncode == 1 and len(lines) == 1, fenced.stderr
    assert "CELERY_FENCE_DATABASE is not set" in lines[0] and "init-db" not in lines[0]
    # and neither left an embedded SQLite file in the project.
    assert not (project / "celery_fence.sqlite3").exists()
    # Naming the store passes manage.py check.
    assert _manage_check(project, CELERY_FENCE_DATABASE="default").returncode == 0


def test_a_short_lease_ttl_alone_is_enough_and_errors_use_the_djangos_spelling(
    project: Path,
) -> None:
    named = {"CELERY_FENCE_DATABASE": "default"}
    # Given only a short CELERY_FENCE_LEASE_TTL, the renew interval follows it (a third):
    alone = _manage_check(project, CELERY_FENCE_LEASE_TTL="6", **named)
    assert alone.returncode == 0, alone.stderr
    shown = _run(
        project,
        ["-c", "from proj.celery import app, double; print(double.fence_config().renew_interval)"],
        CELERY_FENCE_LEASE_TTL="6",
        **named,
    )
    assert shown.returncode == 0 and shown.stdout.strip() == "2.0", shown.stderr
    # and an interval that does not fit is named as the project wrote it, beside the TTL.
    bad = _manage_check(
        project, CELERY_FENCE_LEASE_TTL="6", CELERY_FENCE_RENEW_INTERVAL="5.5", **named
    )
    assert bad.returncode != 0 and "celery_fence.E001" in bad.stderr
    assert "CELERY_FENCE_RENEW_INTERVAL=5.5" in bad.stderr
    assert "CELERY_FENCE_LEASE_TTL x (1 - CELERY_FENCE_LEASE_MARGIN)" in bad.stderr
    assert "fence_renew_interval" not in bad.stderr
    fenced = _fence_check(
        project, CELERY_FENCE_LEASE_TTL="6", CELERY_FENCE_RENEW_INTERVAL="5.5", **named
    )
    assert fenced.returncode == 1 and "CELERY_FENCE_RENEW_INTERVAL=5.5" in fenced.stderr
    assert "fence_renew_interval" not in fenced.stderr
