"""``python -m tests.support.enqueue_and_die KEY...``: enqueue one ``work`` job per key in one
transaction on the store's database, then die by SIGKILL between the commit and the publish (the
window :func:`celery_fence.enqueue` leaves to recovery). Configured by the FENCE_T_* variables."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import sqlalchemy as sa

import celery_fence.durable.sends
from celery_fence import enqueue
from tests.support import app as support


def _die(sends: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(keys: list[str]) -> None:
    celery_fence.durable.sends._publish = _die  # the commit has happened when this is called
    engine = sa.create_engine(os.environ["FENCE_T_DB"])
    with engine.begin() as conn:
        for key in keys:
            enqueue(conn, support.work, args=(key,))
    raise SystemExit("not reached: the process dies after its commit")


if __name__ == "__main__":
    main(sys.argv[1:])
