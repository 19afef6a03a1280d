"""Explicit installation: importing celery_fence leaves Celery apps alone; ``install(app)`` (run
by a fenced task when Celery binds it) adds the beat tasks to that app and connects the
process-wide receivers once, and those receivers ignore every app that was not installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from celery import Celery
from celery import signals as celery_signals
from celery.utils.dispatch import Signal

from celery_fence import FencedTask, install
from celery_fence.adapters.installation import RECEIVERS
from celery_fence.app_state import installed
from celery_fence.ops.recovery import RECOVER_TASK
from celery_fence.ops.retention import PURGE_TASK

FENCE_TASKS = {RECOVER_TASK, PURGE_TASK}

#: Prints the celery-fence tasks of a plain app and every celery-fence receiver of Celery's
#: signals, as JSON, after importing every module that connected or registered something.
_PLAIN_APP = """
import json
from celery import Celery, signals
from celery.utils.dispatch import Signal

import celery_fence
import celery_fence.announce.events, celery_fence.announce.logs, celery_fence.adapters.worker
import celery_fence.ops.outbox, celery_fence.ops.recovery, celery_fence.ops.retention
import celery_fence.signals, celery_fence.store.probe

app = Celery("plain", set_as_current=False)

@app.task(name="plain.add")
def add(x, y):
    return x + y

app.finalize()
receivers = []
for name in dir(signals):
    signal = getattr(signals, name)
    if isinstance(signal, Signal):
        for _, ref in signal.receivers or []:
            fn = getattr(ref, "__self__", ref) if not callable(ref) else ref
            module = getattr(fn, "__module__", "") or ""
            if module.startswith("celery_fence"):
                receivers.append(f"{name}: {module}.{fn.__qualname__}")
print(json.dumps({
    "tasks": sorted(n for n in app.tasks if not n.startswith("celery.")),
    "receivers": receivers,
    "state": "_fence_state" in app.__dict__,
}))
"""

#: One installed app and one plain app in a process: Celery's worker signals sent for the plain
#: one leave it alone, even a task of it that asks for the start-time settings check.
_TWO_APPS = """
import json
from celery import Celery, Task, signals
import celery_fence
from celery_fence.errors import ConfigurationError
from celery_fence.app_state import app_state

fenced = Celery("fenced", set_as_current=False)
celery_fence.install(fenced)
plain = Celery("plain", set_as_current=False)

class Worker:  # what the worker signals are sent by: its app, its -E flag
    def __init__(self, app):
        self.app, self.task_events = app, True

class LooksChecked(Task):
    settings_checked_at_start = True
    def fence_config(self):
        raise ConfigurationError("a plain app's task must never be checked")

@plain.task(base=LooksChecked, name="plain.job", shared=False)
def job():
    return None

plain.finalize()
signals.worker_init.send(sender=Worker(plain))
signals.worker_shutdown.send(sender=Worker(plain))
plain_untouched = "_fence_state" not in plain.__dict__
signals.worker_init.send(sender=Worker(fenced))
print(json.dumps({
    "plain_untouched": plain_untouched,
    "plain_tasks": sorted(n for n in plain.tasks if not n.startswith("celery.")),
    "fenced_events": app_state(fenced).task_events,
}))
"""


def _run(script: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _fence_receivers() -> dict[str, int]:
    """How many celery-fence receivers each of Celery's signals has in this process."""
    counts: dict[str, int] = {}
    for name in dir(celery_signals):
        signal = getattr(celery_signals, name)
        if isinstance(signal, Signal):
            keys = [key for key, _ in signal.receivers or []]
            fence = [k for k in keys if isinstance(k[0], str) and k[0].startswith("celery_fence:")]
            if fence:
                counts[name] = len(fence)
    return counts


def test_importing_celery_fence_gives_a_plain_app_no_task_and_no_receiver() -> None:
    # Given a fresh process that imports celery_fence and every module with receivers or built-in
    # tasks, and a plain app that never uses FencedTask,
    got = _run(_PLAIN_APP)
    # then the app has only its own task, no celery-fence state, and no signal of Celery's
    # has a celery-fence receiver.
    assert got == {"tasks": ["plain.add"], "receivers": [], "state": False}


def test_receivers_ignore_an_app_that_is_not_installed() -> None:
    # Given one installed app (the receivers are connected) and one plain app in a process,
    got = _run(_TWO_APPS)
    # when the worker's start and shutdown signals are sent for the plain app, nothing of it is
    # read or changed (its task that looks checked is not checked: the worker would not start),
    assert got["plain_untouched"] is True
    assert got["plain_tasks"] == ["plain.job"]
    # while the same signal for the installed app is acted on.
    assert got["fenced_events"] is True


def test_install_twice_is_the_same_as_once() -> None:
    app = Celery("install-twice", set_as_current=False)
    # Given an app installed once,
    install(app)
    tasks = {name: task for name, task in app.tasks.items() if name in FENCE_TASKS}
    receivers = _fence_receivers()
    assert set(tasks) == FENCE_TASKS and installed(app)
    # when it is installed again, and a fenced task is bound to it (which installs it too),
    install(app)

    @app.task(base=FencedTask, bind=True, name="install-twice.job")
    def job(self: Any) -> None:
        return None

    app.finalize()
    # then it has the same task objects and the process the same receivers, each once.
    assert {name: app.tasks[name] for name in FENCE_TASKS} == tasks
    assert _fence_receivers() == receivers
    assert sum(receivers.values()) == len(RECEIVERS)


def test_a_second_app_gets_its_own_tasks_and_no_second_receiver() -> None:
    first = Celery("install-first", set_as_current=False)
    second = Celery("install-second", set_as_current=False)
    install(first)
    receivers = _fence_receivers()
    # Given a second app installed in the same process,
    install(second)
    # then it has beat tasks of its own, and the process's receivers stay connected once.
    assert first.tasks[RECOVER_TASK] is not second.tasks[RECOVER_TASK]
    assert second.tasks[PURGE_TASK].app is second
    assert _fence_receivers() == receivers


def test_a_fenced_task_installs_its_app_when_celery_binds_it() -> None:
    app = Celery("bound", set_as_current=False)

    # Given a fenced task declared on an app that is not finalized yet (Celery binds it later),
    @app.task(base=FencedTask, bind=True, name="bound.job")
    def job(self: Any) -> None:
        return None

    assert not installed(app)
    # when the app is finalized (a worker does it at start),
    app.finalize()
    # then the app is installed: its beat tasks are registered, with no line of the user's own.
    assert installed(app)
    assert set(app.tasks) >= FENCE_TASKS
    # And a fenced task declared on an already finalized app installs it at once.
    late = Celery("bound-late", set_as_current=False)
    late.finalize()

    @late.task(base=FencedTask, bind=True, name="bound-late.job")
    def late_job(self: Any) -> None:
        return None

    assert installed(late) and set(late.tasks) >= FENCE_TASKS


#: A fenced task put in the current app's registry as is (not bound: Celery binds it when it first
#: reads its ``app``), in a fresh process (here, other tests' shared tasks would install the app).
_UNBOUND = """
import json
from celery import Celery
from celery_fence import FencedTask
from celery_fence.app_state import installed

app = Celery("unbound")  # the current app, as a worker's is: an unbound task runs under it

class Export(FencedTask):
    name = "unbound.export"

    def run(self, key):
        return key

app.tasks.register(Export())
before = [installed(app), sorted(t for t in app.tasks if t.startswith("celery_fence."))]
app.tasks[Export.name].fence_backends()  # what its first run does
after = [installed(app), sorted(t for t in app.tasks if t.startswith("celery_fence."))]
print(json.dumps({"before": before, "after": after}))
"""


def test_a_fenced_task_registered_without_being_bound_installs_its_app_at_first_use() -> None:
    # Given a fenced task registered without being bound: its app is not installed yet,
    report = _run(_UNBOUND)
    assert report["before"] == [False, []]
    # and its first use binds it, which installs it like any other.
    assert report["after"] == [True, sorted(FENCE_TASKS)]


def test_a_fence_base_installs_nothing_and_each_task_made_from_it_installs_its_app() -> None:
    base_app = Celery("fence-base", set_as_current=False)
    task_app = Celery("fence-base-task", set_as_current=False)

    # Given a base of fenced tasks declared with the marker, and one declared without it,
    class Base(FencedTask, fence_base=True):
        pass

    class NotABase(FencedTask):
        pass

    # when Celery binds the base to an app, that app is not installed (the marker is no
    # Celery attribute: Celery's deprecated ``abstract`` is not read),
    Base.bind(base_app)
    # (``app.tasks`` is not read: finalizing would attach the process's shared fenced tasks)
    assert not installed(base_app)
    assert "abstract" not in Base.__dict__
    # and a task made from the base, and a subclass without the marker, each install their app.
    task_cls: type[FencedTask] = type("made_from_base", (Base,), {"name": "fence-base.job"})
    assert task_cls._fence_base is False
    task_cls.bind(task_app)
    assert installed(task_app)
    other = Celery("fence-not-a-base", set_as_current=False)
    NotABase.bind(other)
    assert installed(other)
