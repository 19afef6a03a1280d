"""The ``celery-once`` variant: a celery_once ``QueueOnce`` task, registered on both sides.

celery_once takes its lock where the message is sent: ``QueueOnce.apply_async`` sets
``qo_<task>_key-<key>`` (``SET NX PX``, redis-py's ``Lock``) before publishing, and the worker
deletes it after the task returns (``after_return``). So the task is registered twice, with the
same name and signature: on the worker's app (:mod:`bench.app`) and on the bench's publishing app
(:meth:`bench.harness.Services.control`), where :func:`bench.harness.publish` sends it through its
own ``apply_async``. The publish happens before the clock starts, as for every variant; the lock's
``SET`` is on the lease Redis, so the per-task Redis counts include it.

celery_once 3.0.1 (2019) runs unchanged on Celery 5.7 and redis-py 8: no shim. It imports
``six`` without declaring it (Celery brings it in through python-dateutil; the bench extra names
it too).
"""

from __future__ import annotations

import time

from celery import Celery

TASK = "bench.once"


def register(app: Celery, lease_redis_url: str) -> None:
    """Configure celery_once on ``app`` (locks in ``lease_redis_url``) and register ``bench.once``
    (acks_late, a no-op unless given ``sleep``; the lock key is the ``key`` argument only)."""
    import celery_once.backends.redis
    from celery_once import QueueOnce

    # celery_once keeps one client per process in a module global: start from this URL.
    celery_once.backends.redis.redis = None
    app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": lease_redis_url}}

    @app.task(name=TASK, base=QueueOnce, acks_late=True, once={"keys": ["key"]}, shared=False)
    def once(key: str, sleep: float = 0.0) -> None:
        if sleep:
            time.sleep(sleep)
