import os

import redis as redis_py  # (the package has a submodule "redis")

from celery_fence.store import Store


class _Reset:
    def flushall(self):
        """The upstream fixture flushes the whole Redis server after each test (its locks and its
        broker's queue). Here: the broker's own Redis DB (the harness's, never a shared one) and
        the fence store's rows — the shim's "locks" are job rows."""
        redis_py.Redis.from_url(os.environ["FENCE_TEST_BROKER_URL"]).flushdb()
        store = Store(os.environ["FENCE_TEST_DATABASE_URL"])
        try:
            store.admin.delete_all_rows()
        finally:
            store.dispose()

    def keys(self, pattern):
        return []


class _Backend:
    redis = _Reset()


def get_backend(config):
    return _Backend()
