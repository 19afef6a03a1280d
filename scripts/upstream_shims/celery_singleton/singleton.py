from celery_fence.compat import Singleton


def clear_locks(app):
    Singleton.clear_locks(app)


__all__ = ["Singleton", "clear_locks"]
