"""celery-singleton's public names, from celery-fence's shim (the upstream suite imports them)."""

from celery_fence.compat import DuplicateTaskError, Singleton

from .singleton import clear_locks

__all__ = ["DuplicateTaskError", "Singleton", "clear_locks"]
