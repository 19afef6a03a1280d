"""Django ORM writes that a fenced block would not cover are refused while the block is open.

Django's ORM writes on its own connection per alias. Inside ``fence.transaction()`` or
``fence.session()`` the fenced commit covers the block's SQLAlchemy connection only, and inside
``fence.atomic(using=alias)`` it covers that alias's transaction only: an ORM write anywhere else
would commit unchecked, and a stale worker's row would land. So while a block is open, this
thread's Django connections get an execute wrapper that refuses any writing statement on an
alias the open block does not cover, with a :class:`~celery_fence.ConfigurationError` that
names the write and the fix (a permanent error: the job ends ``dead`` with that reason).

Reads pass. Only this thread's connections are wrapped (Django's connections are per thread):
writes from threads the body starts itself are outside any block, as they would be anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

from django.db import connections

from celery_fence.body.writes import write_verb
from celery_fence.errors import ConfigurationError


@contextlib.contextmanager
def refuse_uncovered_writes(
    covered: Callable[[], Collection[str]], block: str, fix: Callable[[str], str]
) -> Iterator[None]:
    """While open, refuse Django writes on this thread's connections whose alias is not in
    ``covered()`` (read when the statement runs, so a nested block on another alias counts).
    ``block`` names the open block in the error; ``fix(alias)`` says what to do instead."""

    def wrapper(alias: str) -> Callable[..., Any]:
        def refuse(
            execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
        ) -> Any:
            verb = write_verb(sql)
            if verb is not None and alias not in covered():
                raise ConfigurationError(
                    f"a Django ORM write ({verb} on the {alias!r} database) inside {block}: its "
                    f"fenced commit does not cover Django's {alias!r} connection, so a stale "
                    f"worker's write would land unchecked. {fix(alias)}"
                )
            return execute(sql, params, many, context)

        return refuse

    with contextlib.ExitStack() as stack:
        for alias in connections:
            stack.enter_context(connections[alias].execute_wrapper(wrapper(alias)))
        yield
