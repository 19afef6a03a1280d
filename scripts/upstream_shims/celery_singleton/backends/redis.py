class RedisBackend:
    """Upstream internals: not in the shim (see ../util.py)."""

    def lock(self, *args, **kwargs):
        raise NotImplementedError
