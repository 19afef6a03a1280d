"""Which SQL statements write: the test behind the refusal of writes a fenced block would not
cover (:func:`celery_fence.body.transaction.open_block`,
:mod:`celery_fence.contrib.django.guard`)."""

from __future__ import annotations

from typing import Any

from celery_fence import schema

#: The first words of the statements that write (or change the schema).
WRITES = frozenset(
    {
        "INSERT",
        "UPDATE",
        "DELETE",
        "MERGE",
        "REPLACE",
        "UPSERT",
        "TRUNCATE",
        "COPY",
        "CREATE",
        "DROP",
        "ALTER",
    }
)
#: The fence's own tables: their statements are the fence's, on the store's engine.
FENCE_TABLES = (schema.jobs.name, schema.transitions.name, schema.outbox.name)


def write_verb(statement: Any) -> str | None:
    """The verb of a writing ``statement`` (``INSERT``, ``UPDATE``, ...), else None. A ``WITH``
    statement writes when one of its parts does."""
    text = statement if isinstance(statement, str) else str(statement)
    words = text.lstrip(" \t\r\n(").split(None, 1)
    verb = words[0].upper() if words else ""
    if verb == "WITH":
        upper = text.upper()
        return next((w for w in ("INSERT", "UPDATE", "DELETE") if f"{w} " in upper), None)
    return verb if verb in WRITES else None


def on_fence_tables(statement: str) -> bool:
    return any(table in statement for table in FENCE_TABLES)
