"""Client-side round-trip counting inside a worker child (only when ``BENCH_TRACE=1``).

The servers count commands and statements; they cannot tell a task's blocking round trips from
the ones a background thread sends. This module counts, per worker child, every send to the
lease Redis (one ``send_packed_command`` is one round trip: a pipeline is sent in one call) and
every SQL statement, split by the thread that sent it (redis-py's health-check ``PING`` on a
connection idle for 30 s, and a new connection's set-up commands, are counted apart):

- ``critical``: a thread that runs task bodies (marked at ``task_prerun``): the task waits for it;
- ``off``: any other thread (celery-fence's renewer, python-redis-lock's renewal threads).

A PostgreSQL ``BEGIN``, ``COMMIT`` or ``ROLLBACK`` outside autocommit, and a pool's pre-ping,
count as statements.

Counts are cumulative and written to ``<BENCH_TRACE_DIR>/trace-<pid>.json`` every 50 ms, so the
bench reads them from outside and takes differences. The timed runs use workers without tracing.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

_local = threading.local()
_counts: Counter[str] = Counter()
_lock = threading.Lock()


def mark_task_thread() -> None:
    _local.task = True


def _path() -> str:
    return "critical" if getattr(_local, "task", False) else "off"


def _add(target: str) -> None:
    with _lock:
        _counts[f"{target}:{_path()}"] += 1


def install(lease_redis_port: int, out_dir: str) -> None:
    """Patch the redis-py connection and listen on every SQLAlchemy engine; start the dumper."""
    import redis.connection
    import sqlalchemy as sa

    original = redis.connection.AbstractConnection.send_packed_command

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> Any:
        if getattr(self, "port", None) == lease_redis_port:
            first = command if isinstance(command, (bytes, str)) else command[0]
            head = first[:32].encode("latin-1") if isinstance(first, str) else bytes(first[:32])
            # redis-py's PING before using a connection idle for health_check_interval (30 s),
            # and the commands it sends on a new connection, are per connection, not per task:
            # they are counted on their own.
            if b"PING" in head:
                _add("redis-health")
            elif any(word in head for word in (b"CLIENT", b"HELLO", b"SELECT", b"AUTH")):
                _add("redis-connect")
            else:
                _add("redis")
        return original(self, command, check_health)

    redis.connection.AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]

    def before_cursor_execute(conn: Any, *_: Any) -> None:
        _add(conn.dialect.name)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", before_cursor_execute)

    # Outside autocommit, psycopg2 sends BEGIN (before the first statement) and COMMIT/ROLLBACK
    # as round trips of their own, which cursor events do not see (Celery's database result
    # backend runs in such transactions; the fence store's connections are autocommit).
    def transaction_control(conn: Any) -> None:
        if conn.dialect.name == "postgresql" and not conn.connection.dbapi_connection.autocommit:
            _add("postgresql")

    for event in ("begin", "commit", "rollback"):
        sa.event.listen(sa.engine.Engine, event, transaction_control)

    # A pool with pool_pre_ping (Celery's database backend's default) pings on every checkout of
    # a pooled connection, on a raw cursor that no event sees.
    from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

    original_ping = PGDialect_psycopg2.do_ping

    def do_ping(self: Any, dbapi_connection: Any) -> bool:
        _add("postgresql")
        return bool(original_ping(self, dbapi_connection))

    PGDialect_psycopg2.do_ping = do_ping  # type: ignore[method-assign]

    # The two critical-path statements skip SQLAlchemy's cursor events (they run as prepared
    # statements on a raw DB-API cursor): count each EXECUTE here; the one-off PREPARE per
    # connection is counted apart.
    from celery_fence.store import engine as store_engine

    original_execute = store_engine.execute_prepared

    def execute_prepared(raw: Any, cursor: Any, statement: str, params: dict[str, Any]) -> Any:
        _add("postgresql")
        if statement not in raw.info.get("fence_prepared", {}):
            _add("postgresql-prepare")
        return original_execute(raw, cursor, statement, params)

    store_engine.execute_prepared = execute_prepared

    target = Path(out_dir) / f"trace-{os.getpid()}.json"

    def dump_forever() -> None:
        while True:
            with _lock:
                data = dict(_counts)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(target)
            threading.Event().wait(0.05)

    threading.Thread(target=dump_forever, name="bench-trace-dump", daemon=True).start()


def read_all(out_dir: str) -> Counter[str]:
    """The sum of every child's cumulative counts."""
    total: Counter[str] = Counter()
    for path in Path(out_dir).glob("trace-*.json"):
        try:
            total.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return total
