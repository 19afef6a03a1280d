"""The process groups a test or harness started, and how they all die.

Each child runs in its own session (``start_new_session``), so its process group is its pid:
SIGSTOP/SIGCONT/SIGKILL reach a worker's main process and its prefork children together. Every
child is registered here, so :func:`cleanup` (run at interpreter exit, and on SIGINT/SIGTERM once
:func:`install_handlers` was called) kills the groups a caller forgot. Nothing is ever killed by
name.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

_children: list[subprocess.Popen[bytes]] = []
_closers: list[Callable[[], None]] = []
_lock = threading.RLock()  # re-entrant: a signal handler may interrupt a holder
_handlers_installed = False


def register(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc``'s process group in :func:`cleanup` unless it already ended."""
    with _lock:
        _children[:] = [p for p in _children if p.poll() is None]
        _children.append(proc)


def register_closer(fn: Callable[[], None]) -> None:
    """Run ``fn`` (e.g. stop a proxy or drop a database) in :func:`cleanup`."""
    with _lock:
        _closers.append(fn)


def read_log(path: Path) -> str:
    """What a child wrote to its log file so far ("" before the file exists)."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pid`` (a child started by this module); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_child(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s whole group (one of ours) and reap it."""
    if proc.poll() is None:
        kill_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def stop_child(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM ``proc``'s whole group; SIGKILL it if it has not exited within ``timeout``."""
    if proc.poll() is None:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_child(proc)


def group_alive(pid: int) -> bool:
    """True while any process of group ``pid`` exists (zombies of our own children excluded)."""
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def cleanup() -> None:
    """Kill every process group started here that is still registered, then run the closers."""
    with _lock:
        children, _children[:] = list(_children), []
        closers, _closers[:] = list(reversed(_closers)), []
    for proc in children:
        kill_group(proc.pid, signal.SIGCONT)  # a stopped process does not die of SIGTERM
        kill_group(proc.pid, signal.SIGKILL)
    for proc in children:
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)
    for fn in closers:
        with contextlib.suppress(Exception):
            fn()


atexit.register(cleanup)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    cleanup()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    """SIGINT/SIGTERM handlers that call :func:`cleanup` (for command-line harnesses; pytest
    handles Ctrl-C itself and tears the fixtures down)."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
