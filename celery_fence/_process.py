"""This process's id, kept current across forks by an at-fork hook.

The hot path asks "was I forked since this object was made?" several times a task; comparing
with :data:`pid` answers it without an ``os.getpid()`` system call each time.
"""

from __future__ import annotations

import os

#: The current process's id (updated in a forked child before any other code runs there).
pid = os.getpid()


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
