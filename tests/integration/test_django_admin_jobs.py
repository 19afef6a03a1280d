"""The Django admin of the fenced jobs, on the billing example: lease column (read from Redis),
millisecond timestamps, keys as stored, the error column, search by task name and by error,
"Recover stranded jobs" without a selection, the admin user recorded on requeue — and the page
checked in a real headless Chromium at 1400 px (its DOM, and a screenshot).

The example project (example_project/django_billing) runs as a subprocess on a SQLite file of
this test's own, with a settings overlay that adds a one-time login URL (Chromium cannot be
handed a session cookie from the command line).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_fence.testing.processes import free_port
from tests.support.env import BROKER_URL, REDIS_URL
from tests.support.worker import ROOT, wait_until

BILLING = ROOT / "example_project" / "django_billing"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

OVERLAY = """
from billing_project.settings import *  # noqa

ROOT_URLCONF = "browser_urls"
DEBUG = True
MIDDLEWARE = [*MIDDLEWARE, "browser_urls.MeasureColumns"]
CELERY_BROKER_URL = {broker!r}
CELERY_RESULT_BACKEND = {broker!r}
CELERY_FENCE_REDIS_URL = {redis!r}
CELERY_FENCE_KEY_PREFIX = {prefix!r}
"""

URLS = """
import os
from django.contrib import admin
from django.contrib.auth import login
from django.contrib.auth.models import User
from django.http import HttpResponseForbidden, HttpResponseRedirect
from django.urls import path


def login_as(request, token):
    # test only: log the browser in (a one-time token from the environment), then go on
    if token != os.environ["ADMIN_TEST_TOKEN"]:
        return HttpResponseForbidden()
    login(request, User.objects.get(username="alice"))
    return HttpResponseRedirect(request.GET.get("next", "/admin/"))


class MeasureColumns:
    # test only: after layout, write each list column's right edge into <body data-columns>
    SCRIPT = (
        b"<script>window.addEventListener('load', () => {const r = {};"
        b"document.querySelectorAll('#result_list thead th').forEach(th => {"
        b"const c = [...th.classList].find(n => n.startsWith('column-')) || th.className;"
        b"r[c] = Math.round(th.getBoundingClientRect().right);});"
        b"const clip = document.querySelector('#result_list').parentElement;"
        b"r.visible = Math.round(Math.min(clip.getBoundingClientRect().right, window.innerWidth));"
        b"document.body.dataset.columns = JSON.stringify(r);});"
        b"</script></body>"
    )

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.get("Content-Type", "").startswith("text/html") and not response.streaming:
            response.content = response.content.replace(b"</body>", self.SCRIPT)
        return response


urlpatterns = [path("login-as/<str:token>/", login_as), path("admin/", admin.site.urls)]
"""

SETUP = """
import datetime as dt, json, sys, django
django.setup()
from django.core.management import call_command
from django.contrib.auth.models import User
from celery_fence.contrib.django.settings import fence_config
from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.store.records import Completion, Dead
import redis

call_command("migrate", verbosity=0)
User.objects.create_superuser("alice", "alice@example.com", "pw")
config = fence_config()
store = Store(config.database_url)
done, dead, running, tag = sys.argv[1:5]
task = "billing.tasks.bill_invoice"
queue = "admin-test-" + tag  # the requeue's message goes there (deleted after the test)
request = {"task": task, "id": tag, "args": [7], "kwargs": {}, "options": {"routing_key": queue}}
store.register(done, generation=1, attempt_id="a-done", task_name=task)
store.end(done, Completion(generation=1, attempt_id="a-done", result={"total": 12}))
store.register(dead, generation=1, attempt_id="a-dead", task_name=task, request=request)
error = ConnectionRefusedError("payment provider refused the connection " + "x" * 300)
store.end(dead, Dead(generation=1, attempt_id="a-dead", error=error, reason="gave up",
                     attempts=5))
leases = LeaseStore(redis.Redis.from_url(config.redis_url), prefix=config.key_prefix)
generation = leases.claim(running, "token-running", 60_000)
store.register(running, generation=generation, attempt_id="a-running", task_name=task)
print(json.dumps({"generation": generation}))
"""

CLIENT = """
import json, sys, django
django.setup()
from django.contrib.auth.models import User
from django.test import Client
from celery_fence.contrib.django.settings import fence_config
from celery_fence.store import Store

dead, tag, running = sys.argv[1:4]
client = Client()
client.force_login(User.objects.get(username="alice"))
base = "/admin/celery_fence/job/"
by_task = client.get(base, {"q": "bill_invoice"}).content.decode()
by_error = client.get(base, {"q": "ConnectionRefused"}).content.decode()
by_nothing = client.get(base, {"q": "no-such-thing-" + tag}).content.decode()
from django.contrib.admin.utils import quote
change = client.get(base + quote(running) + "/change/").content.decode()
recover = client.post(base + "recover/", follow=True)
recover_get = client.get(base + "recover/")
requeue = client.post(
    base, {"action": "requeue_dead", "index": "0", "_selected_action": [dead]}, follow=True
)
store = Store(fence_config().database_url)
history = [(t.action, t.reason) for t in store.transitions.history(dead)]
print(json.dumps({
    "change": change, "by_task": by_task, "by_error": by_error, "by_nothing": by_nothing,
    "recover_status": recover.status_code, "recover": recover.content.decode(),
    "recover_get": recover_get.status_code,
    "requeue": requeue.content.decode(), "history": history,
}))
"""


class Project:
    """The billing example with the overlay, in ``tmp_path``, its jobs written."""

    def __init__(self, tmp_path: Path, prefix: str) -> None:
        self.dir = tmp_path
        self.tag = uuid.uuid4().hex[:8]
        self.done = f"invoice:Done-{self.tag}"
        self.dead = f"invoice:deadBeef-{self.tag}"
        self.running = f"invoice:runningX-{self.tag}"
        self.token = uuid.uuid4().hex
        (tmp_path / "browser_settings.py").write_text(
            OVERLAY.format(broker=BROKER_URL, redis=REDIS_URL, prefix=prefix)
        )
        (tmp_path / "browser_urls.py").write_text(URLS)
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "browser_settings",
            "BILLING_DATABASE": "sqlite",
            "BILLING_DB_NAME": str(tmp_path / "billing.sqlite3"),
            "ADMIN_TEST_TOKEN": self.token,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(BILLING), str(ROOT)]),
        }
        out = self.script(SETUP, self.done, self.dead, self.running, self.tag)
        self.generation = int(out["generation"])

    def script(self, text: str, *args: str) -> dict[str, Any]:
        path = self.dir / f"script_{uuid.uuid4().hex[:6]}.py"
        path.write_text(text)
        proc = subprocess.run(
            [sys.executable, str(path), *args],
            cwd=self.dir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture
def project(tmp_path: Path, prefix: str, redis_client: redis.Redis) -> Iterator[Project]:
    made = Project(tmp_path, prefix)
    yield made
    for key in redis_client.scan_iter(f"{prefix}:*"):
        redis_client.delete(key)
    broker = redis.Redis.from_url(BROKER_URL)
    queue = f"admin-test-{made.tag}"
    broker.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    broker.close()


def test_admin_searches_recovers_without_selection_and_records_who_requeued(
    project: Project, redis_client: redis.Redis
) -> None:
    doc = project.script(CLIENT, project.dead, project.tag, project.running)
    # A job's page shows its lease (read from Redis), its key as stored, times to the ms,
    assert re.search(rf"gen {project.generation}, \d+\.\d s left", doc["change"])
    assert project.running in doc["change"]
    assert re.search(r"\d\d:\d\d:\d\d\.\d{3}", doc["change"])
    # search finds jobs by task name and by error (type or message), not only by key,
    assert project.done in doc["by_task"] and project.dead in doc["by_task"]
    assert project.dead in doc["by_error"] and project.done not in doc["by_error"]
    assert project.dead not in doc["by_nothing"]
    # "Recover stranded jobs" runs with no row ticked (a POST; a GET is refused),
    assert doc["recover_status"] == 200 and "stranded job(s)" in doc["recover"]
    assert "Items must be selected" not in doc["recover"]
    assert doc["recover_get"] == 405
    # and a requeue from the admin names the admin user in the transition's reason.
    # (the message shows the key as stored: Django capitalises a message's first letter, so it
    # begins with "job", never with the key)
    assert f"Job {project.dead}: requeued as" in doc["requeue"]
    assert ("requeued", "requeued by admin user alice") in [tuple(h) for h in doc["history"]]


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (scripts/services installs it: apt-get install chromium)",
)
def test_admin_page_in_a_headless_browser_at_1400px(project: Project) -> None:
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(BILLING / "manage.py"),
            "runserver",
            f"127.0.0.1:{port}",
            "--noreload",
        ],
        cwd=project.dir,
        env=project.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def up() -> bool:
            try:
                import urllib.request

                urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=2)
                return True
            except OSError:
                return False

        wait_until(up, 60, 0.3, what="runserver up")
        page = f"http://127.0.0.1:{port}/login-as/{project.token}/?next=/admin/celery_fence/job/"

        def chromium(*args: str) -> str:
            proc = subprocess.run(
                [
                    str(CHROMIUM),
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    f"--user-data-dir={project.dir / 'chrome'}",
                    "--window-size=1400,900",
                    "--virtual-time-budget=3000",
                    *args,
                    page,
                ],
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            return proc.stdout

        dom = chromium("--dump-dom")
        shot = project.dir / "admin.png"
        chromium(f"--screenshot={shot}")
        (project.dir / "dom.html").write_text(dom)
        if os.environ.get("FENCE_ADMIN_SCREENSHOT"):  # refresh docs/admin.png
            shutil.copy(shot, os.environ["FENCE_ADMIN_SCREENSHOT"])
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=15)
    # The logged-in list of fenced jobs,
    assert "Select fenced job to view" in dom or "fenced jobs" in dom.lower()
    # keys exactly as stored (case kept),
    for key in (project.done, project.dead, project.running):
        assert re.search(
            rf'<code class="fence-key" style="text-transform:none[^"]*">{key}</code>', dom
        )
    # timestamps to the millisecond,
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", dom)
    # the lease column: the running job's holder generation and time left, none for the others,
    assert 'class="column-lease' in dom
    assert re.search(rf"gen {project.generation}, \d+\.\d s left", dom)
    # the error column, truncated (the whole error in its tooltip),
    assert "ConnectionRefusedError: payment provider refused the connection" in dom
    assert "\u2026</span>" in dom
    # the "Recover stranded jobs" button,
    assert 'id="fence-recover"' in dom
    # and at 1400 px every column, the error column included, ends inside the list's box (the
    # admin clips a wide table there and scrolls it sideways: a clipped column is not seen).
    match = re.search(r'data-columns="([^"]+)"', dom)
    assert match, "the page's column measurement is missing"
    columns = json.loads(match.group(1).replace("&quot;", '"'))
    visible = columns.pop("visible")
    assert 0 < columns["column-error"] <= visible, columns
    assert all(right <= visible for right in columns.values()), (visible, columns)
    assert shot.stat().st_size > 10_000
