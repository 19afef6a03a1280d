"""``celery_fence.contrib.django.enqueue(task, ...)``: the job's ``pending`` row on Django's own
connection, in your ``transaction.atomic()``, its message sent by ``transaction.on_commit``
(``celery_fence.enqueue(None, task, ...)``, deprecated, does the same).

The connection is Django's for the store's alias (``CELERY_FENCE_DATABASE``, else ``default``),
which must be the store's database: the row is written through Django's cursor (the store's own
statement, in ``%s`` style), so it commits or rolls back with your ORM writes, a rolled-back
savepoint (a nested ``atomic()``) included: Django discards the savepoint's ``on_commit`` send with
it. The publish runs after the outermost commit; a process that dies first leaves the row
``pending`` for ``fence recover``.

A manual savepoint (``sid = transaction.savepoint()`` ... ``transaction.savepoint_rollback(sid)``)
removes the row, but Django keeps the ``on_commit`` callbacks registered inside it (it only
tracks the savepoints of ``atomic()``). So the send first reads the job's row after the commit,
on the same connection: it publishes only when the row is there with this send's task id. A
row rolled back with its savepoint sends nothing; a read that fails sends nothing either and
leaves a committed row to ``fence recover``.

Outside an atomic block (autocommit) :func:`enqueue` refuses: each of your ORM
writes would already be committed on its own, so a crash between them and the enqueue would lose
the job the promise is about (data committed, no row). Wrap the writes and the enqueue in
``transaction.atomic()`` (``ATOMIC_REQUESTS`` does it for a view).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db import transaction as django_transaction

from celery_fence import durable
from celery_fence.actions import LogAction
from celery_fence.contrib.django.database import same_database_problem
from celery_fence.durable import sends
from celery_fence.errors import ConfigurationError

if TYPE_CHECKING:
    from celery_fence.store import Store

logger = logging.getLogger("celery_fence.durable")


class DjangoTarget:
    """The job's row on Django's ``alias`` connection, its send on that alias's commit."""

    def __init__(self, alias: str, store: Store) -> None:
        self.alias = alias
        self.store = store
        self.connection = connections[alias]

    def insert(
        self, key: str, task_name: str, request: Mapping[str, Any], due: dt.datetime | None
    ) -> tuple[bool, str | None, Mapping[str, Any] | None]:
        with self.connection.cursor() as cursor:
            return self.store.pending.insert_cursor(
                cursor, key, task_name=task_name, request=request, due=due
            )

    def after_commit(self, send: sends.Send) -> None:
        django_transaction.on_commit(lambda: self.publish_if_committed(send), using=self.alias)

    def publish_if_committed(self, send: sends.Send) -> None:
        """Publish ``send`` when its row committed (it is there, with this send's task id)."""
        try:
            with connections[self.alias].cursor() as cursor:
                found = self.store.pending.status_and_request_cursor(cursor, send.key)
        except Exception as exc:  # committed or not, the row (if any) is the record
            logger.warning(
                "fence enqueue could not read key=%s after the commit (%s); not sent: a "
                "committed job stays pending and 'celery fence recover' sends it",
                send.key,
                type(exc).__name__,
                extra={"action": LogAction.ENQUEUE_UNSENT, "fence_key": send.key},
            )
            return
        stored_id = (found[1] or {}).get("id") if found is not None else None
        if stored_id != send.task_id:
            logger.info(
                "fence enqueue sent nothing for key=%s task=%s: its row was rolled back with a "
                "savepoint",
                send.key,
                send.task_id,
                extra={"action": LogAction.ENQUEUE_ROLLED_BACK, "fence_key": send.key},
            )
            return
        sends.publish([send])


def enqueue(
    task: Any,
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> durable.Enqueued:
    """``enqueue(bill_invoice, args=(invoice.pk,))`` inside ``transaction.atomic()``: write
    ``task(*args, **kwargs)`` as a ``pending`` job on Django's connection for the store's alias
    (``CELERY_FENCE_DATABASE``, else ``default``), in your transaction, and send it when that
    transaction commits. ``options`` are :func:`celery_fence.enqueue`'s (``apply_async``'s,
    stored with the job); see the module docstring."""
    return durable.enqueue_on(
        lambda store: django_target(task, store), task, args, kwargs, **options
    )


def django_target(task: Any, store: Store) -> DjangoTarget:
    """Django's connection for the store's alias, checked: on the store's database, inside
    ``transaction.atomic()``."""
    alias = task.fence_config().database or DEFAULT_DB_ALIAS
    if alias not in connections.settings:
        raise ConfigurationError(
            f"enqueue() writes on Django's {alias!r} database, which is not in DATABASES: set "
            "CELERY_FENCE_DATABASE to the alias of your app's database"
        )
    connection = connections[alias]
    problem = same_database_problem(store.url, alias, connection.settings_dict)
    if problem is not None:
        raise ConfigurationError(
            f"enqueue(): Django's {alias!r} database is not the fence store's ({problem}). The "
            "job's row is written in your transaction, so both live in one database: set "
            f"CELERY_FENCE_DATABASE = {alias!r} (and run manage.py migrate), or drop "
            "CELERY_FENCE_DATABASE_URL."
        )
    if not connection.in_atomic_block:
        raise ConfigurationError(
            f"enqueue() outside transaction.atomic() (Django's {alias!r} connection is in "
            "autocommit): the job's row must commit with your data, so wrap both in "
            f"`with transaction.atomic(using={alias!r}):` (ATOMIC_REQUESTS does it for a view)"
        )
    return DjangoTarget(alias, store)


__all__ = ["DjangoTarget", "django_target", "enqueue"]
