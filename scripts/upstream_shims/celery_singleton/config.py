class Config:
    """Upstream internals: not in the shim (see util.py)."""

    def __init__(self, app):
        self.app = app
