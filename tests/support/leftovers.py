"""Finding and killing what a failed test left running.

A program under test (the demo, the chaos harness) starts its workers and redis-servers each in a
process group of its own, and stops them itself on success, failure and Ctrl-C. When the test
fails first and SIGKILLs the program, those groups outlive it: these helpers find them by what
only they can mention (the test's own directory, a run id) and kill them by process group, never
by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from celery_fence.testing.processes import group_alive, poll_until


def processes_mentioning(marker: str) -> list[int]:
    """Pids of this user's processes whose command line, environment or working directory
    contains ``marker`` (redis-server rewrites its command line, but runs in its directory)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            mentions = (
                needle in (entry / "cmdline").read_bytes()
                or needle in (entry / "environ").read_bytes()
                or marker in os.readlink(entry / "cwd")
            )
        except OSError:  # gone meanwhile, or not ours
            continue
        if mentions:
            found.append(int(entry.name))
    return found


def kill_groups(pids: Iterable[int], timeout: float = 10.0) -> None:
    """SIGKILL the process group of each of ``pids`` (never the test's own) and wait, bounded,
    until they are gone."""
    own = os.getpgrp()
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(pid))
    groups.discard(own)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGCONT)  # a stopped process does not die until continued
            os.killpg(group, signal.SIGKILL)
    poll_until(lambda: not any(group_alive(g) for g in groups), timeout)


def ctrl_c_default() -> None:
    """``preexec_fn`` for a program a test will Ctrl-C: SIGINT back to its default, so Python
    raises KeyboardInterrupt there even when this test run inherited SIGINT ignored (a shell's
    background job without job control starts that way, and its children keep it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
