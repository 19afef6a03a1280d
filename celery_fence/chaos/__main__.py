"""``python -m celery_fence.chaos``: see :mod:`celery_fence.chaos`."""

from __future__ import annotations

import sys

from celery_fence.chaos.command import main

if __name__ == "__main__":
    sys.exit(main())
