"""The files one warm fenced task runs through, from the message to its ack.

``python -m bench.happy_path [--rev REV ...]`` runs, for the working tree and for each ``REV``
(``celery_fence/`` as of that git revision, unpacked with ``git archive``), a child process that
queues two tasks of a ``FencedTask`` (SQLite store, the local Redis for leases and as broker) and
then runs a solo-pool worker in its main thread with a profiler on it. The second task is the one
counted (the first warms the caches): the window opens when Celery's strategy hands the worker
the message and closes when the request acknowledges it. Printed: each revision's count of
``celery_fence`` files, and the files; ``--json`` writes them too.

It counts files a call passes through on the worker's main thread, so a module touched by one
attribute read counts as much as the pipeline; the renewer thread is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REDIS = os.environ.get("BENCH_HAPPY_REDIS", "redis://127.0.0.1:6379")
VERBOSE = bool(os.environ.get("BENCH_HAPPY_FUNCTIONS"))  # list file:function, not files


def child(out: Path, workdir: Path) -> None:  # pragma: no cover - runs in its own process
    """Queue two tasks, run a solo worker, write the second task's files to ``out``, stop."""
    import signal
    import threading

    from celery import Celery
    from celery.signals import worker_ready

    import celery_fence
    from celery_fence import FencedTask

    package = str(Path(celery_fence.__file__).resolve().parent)
    queue = f"happy-{uuid.uuid4().hex[:8]}"
    app = Celery("happy", broker=f"{REDIS}/9")
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        fence_redis_url=f"{REDIS}/1",
        fence_database_url=f"sqlite:///{workdir / 'fence.sqlite3'}",
        fence_key_prefix=queue,
    )

    @app.task(base=FencedTask, name="happy.noop", fence_key=lambda key: key)
    def noop(key: str) -> str:
        return key

    windows: list[set[str]] = []
    state: dict[str, Any] = {"open": None}

    def profile(frame: Any, event: str, _arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "task_message_handler":
            state["open"] = set()
        elif state["open"] is not None and event == "call":
            if code.co_filename.startswith(package):
                name = os.path.relpath(code.co_filename, os.path.dirname(package))
                state["open"].add(f"{name}:{code.co_name}" if VERBOSE else name)
        elif (
            state["open"] is not None
            and event == "return"
            and code.co_name == "acknowledge"
            and code.co_filename.endswith(os.path.join("celery", "worker", "request.py"))
        ):
            windows.append(state["open"])
            state["open"] = None
            if len(windows) == 2:
                out.write_text(json.dumps(sorted(windows[1])))
                threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()

    @worker_ready.connect(weak=False)
    def _profile(**_: Any) -> None:
        sys.setprofile(profile)

    for n in range(2):
        noop.delay(f"happy:{queue}:{n}")
    app.Worker(
        pool="solo",
        concurrency=1,
        queues=[queue],
        loglevel="WARNING",
        quiet=True,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    ).start()


def measure(source: Path | None, workdir: Path) -> list[str]:
    """The files of the counted task with ``celery_fence`` from ``source`` (None: this tree)."""
    out = workdir / "files.json"
    path = [str(source)] if source else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    subprocess.run(
        [sys.executable, "-m", "bench.happy_path", "--child", str(out), str(workdir)],
        cwd=workdir,
        env=env,
        check=True,
        timeout=120,
    )
    files: list[str] = json.loads(out.read_text())
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.happy_path", description=__doc__)
    parser.add_argument("--rev", action="append", default=[], help="also measure this revision")
    parser.add_argument("--json", type=Path, help="write {revision: [files]} here")
    parser.add_argument("--child", nargs=2, metavar=("OUT", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]))
        return 0
    from bench.run import export_revision

    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="fence-happy-") as tmp:
        for rev in [*args.rev, "working tree"]:
            workdir = Path(tmp) / f"run-{len(results)}"
            workdir.mkdir()
            source = None if rev == "working tree" else Path(export_revision(rev, workdir / "src"))
            results[rev] = measure(source, workdir)
    for rev, files in results.items():
        print(f"{rev}: {len(files)} celery_fence files")
        for name in files:
            print(f"    {name}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
