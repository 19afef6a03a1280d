"""A pytest plugin (``-p tests.support.hide_psycopg3``) that hides psycopg 3 from the process, as
in an environment with psycopg2 only: Django then runs its PostgreSQL backend on psycopg2."""

from __future__ import annotations

import sys

for _name in ("psycopg", "psycopg_binary", "psycopg_c"):
    sys.modules[_name] = None  # type: ignore[assignment]  # import raises ImportError
