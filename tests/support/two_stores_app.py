"""The test app (:mod:`tests.support.app`) with one more fenced task on a store of its own
(``FENCE_T_DB2``): ``celery fence check`` must probe every store the app's tasks use."""

from __future__ import annotations

import os
from typing import Any

from celery_fence import FencedTask
from tests.support.app import app

__all__ = ["app"]


@app.task(
    shared=False,
    base=FencedTask,
    bind=True,
    name="tests.two_stores.elsewhere",
    fence_key=lambda key: key,
    fence_database_url=os.environ["FENCE_T_DB2"],
)
def elsewhere(self: Any, key: str) -> str:
    return key
