"""``--experiment``: two candidate hot-path changes, measured against the shipped code in one run.

Applied by monkeypatching, only in a second worker started with ``BENCH_EXPERIMENT=1`` (the
``fenced-pg-exp`` variant); nothing here changes celery-fence itself. They quantify suggestions
for the core:

1. the renewer thread is woken only when its plan changes (the first lease after idling, the
   first queued release), not on every ``add``/``discard``: each wake-up is a thread switch and
   a GIL hand-over in the middle of the task;
2. the two hot statements run on a pooled raw DB-API connection (cursor ``execute`` +
   ``fetchone``) instead of ``Connection.exec_driver_sql``, skipping SQLAlchemy's connection,
   transaction and result wrappers, as server-side prepared statements (``PREPARE`` once per
   connection, then ``EXECUTE``): PostgreSQL parses and plans them once, not on every task
   (PostgreSQL only; SQLite keeps the shipped path).
"""

from __future__ import annotations

import re
import threading
from collections import namedtuple
from typing import Any

from celery_fence import renewer as renewer_module
from celery_fence import statements
from celery_fence import store as store_module

Row = namedtuple("Row", "key generation attempt_id attempts")


def apply() -> None:
    Renewer = renewer_module.Renewer

    def add(self: Any, lease: Any) -> None:
        self._ensure_process()
        with self._cond:
            idle = not self._held and not self._releases
            self._held[lease.value] = lease
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(
                    target=self._run, name="celery-fence-renewer", daemon=True
                )
                self._thread.start()
            elif idle:  # the thread waits without a deadline: give it one
                self._cond.notify()

    def discard(self: Any, lease: Any, *, release: bool = True) -> None:
        self._ensure_process()
        with self._cond:
            self._held.pop(lease.value, None)
            if release:
                first = not self._releases
                if first:
                    self._release_due = (
                        renewer_module.time.monotonic() + renewer_module.RELEASE_DELAY
                    )
                self._releases.append((lease.lease_key, lease.value))
                if first:  # later releases share the deadline the thread already knows
                    self._cond.notify()

    Renewer.add = add  # type: ignore[method-assign]
    Renewer.discard = discard  # type: ignore[method-assign]

    Store = store_module.Store
    shipped = Store._hot_write

    def _hot_write(
        self: Any, sql: str, params: dict[str, Any], *, action: str, effects: Any = ()
    ) -> Any:
        if self.dialect != "postgresql" or effects:
            return shipped(self, sql, params, action=action, effects=effects)
        params["now"] = store_module.utcnow()
        if self.record_transitions:
            sql = statements.pg_with_records(sql, action=action, transitions=True, effects=False)
        raw = self.engine.raw_connection()
        try:
            prepared: dict[str, tuple[str, list[str]]] = raw.info.setdefault("bench_prepared", {})
            cursor = raw.cursor()
            try:
                if sql not in prepared:
                    prepared[sql] = _prepare(cursor, f"fence_hot_{len(prepared)}", sql)
                name, names = prepared[sql]
                placeholders = ", ".join(["%s"] * len(names))
                cursor.execute(f"EXECUTE {name} ({placeholders})", [params[n] for n in names])
                row = cursor.fetchone()
            finally:
                cursor.close()
        finally:
            raw.close()  # back to the pool
        return None if row is None else Row(*row)

    Store._hot_write = _hot_write  # type: ignore[method-assign]


def _prepare(cursor: Any, name: str, sql: str) -> tuple[str, list[str]]:
    """``PREPARE name AS`` the statement with ``%(param)s`` turned into ``$n``."""
    names: list[str] = []

    def positional(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)s", positional, sql)
    cursor.execute(f"PREPARE {name} AS {text}")
    return name, names
