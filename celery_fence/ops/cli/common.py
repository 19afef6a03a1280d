"""The ``fence`` command group and what its verbs share: the one-line errors, the app's
settings and store, and the text and JSON renderings of times, jobs and tables."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import click
import sqlalchemy as sa
from celery.bin.base import CeleryCommand, handle_preload_options
from celery.exceptions import CeleryCommandException

from celery_fence.config import FenceConfig
from celery_fence.errors import FenceError
from celery_fence.ops.scope import Scope
from celery_fence.pipeline.backends import store_for
from celery_fence.store import JobRecord, OutboxRow, Store
from celery_fence.store.driver_errors import missing_database_message, missing_database_name
from celery_fence.store.records import never_claimed

EX_FAILURE = 1
EX_USAGE = 2


class FenceCLIError(CeleryCommandException):
    """One line on stderr (``Error: ...``) and a non-zero exit."""

    def __init__(self, message: str, exit_code: int = EX_FAILURE) -> None:
        # one line, whatever the cause printed
        super().__init__(message=" ".join(message.split()), exit_code=exit_code)


def describe(exc: BaseException, command: str = "celery -A <app>") -> str:
    """A one-line description of an error from the store, Redis or the broker (no payloads);
    ``command`` is how the hints spell ``celery -A proj``."""
    import kombu.exceptions
    import redis.exceptions

    if isinstance(exc, FenceError):
        return str(exc)
    if isinstance(exc, sa.exc.DBAPIError):
        detail = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ""
        missing = missing_database_name(exc)
        if missing is not None:  # not the tables: the database itself
            return missing_database_message(missing, None, command)
        if "no such table" in detail or "does not exist" in detail:
            return f"the celery-fence tables are missing ({detail}): run '{command} fence init-db'"
        return f"database error ({type(exc.orig).__name__}): {detail}"
    if isinstance(exc, sa.exc.SQLAlchemyError):
        return f"database error ({type(exc).__name__}): {str(exc).splitlines()[0]}"
    if isinstance(exc, redis.exceptions.RedisError):
        return f"Redis error ({type(exc).__name__}): {exc}"
    if isinstance(exc, kombu.exceptions.OperationalError):
        return f"broker error ({type(exc).__name__}): {exc}"
    return f"{type(exc).__name__}: {exc}"


class FenceGroup(click.Group):
    """Turns every error of a sub-command, including its option parsing, into one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, FenceCLIError):
            raise
        except click.UsageError as exc:
            raise FenceCLIError(exc.format_message(), EX_USAGE) from None
        except click.ClickException as exc:
            raise FenceCLIError(exc.format_message(), exc.exit_code) from None
        except Exception as exc:
            raise FenceCLIError(describe(exc, celery_command(ctx))) from None


@click.group(cls=FenceGroup, name="fence")
@click.pass_context
@handle_preload_options
def fence(ctx: click.Context, **kwargs: Any) -> None:
    """celery-fence: inspect, recover, requeue and purge fenced jobs; list and requeue outbox
    effects; create the schema."""


def config_of(ctx: click.Context) -> FenceConfig:
    """The settings of the ``celery -A`` app."""
    return FenceConfig.from_app(ctx.obj.app)


def celery_command(ctx: click.Context) -> str:
    """``celery -A <the app this command was given>`` for the hints a message prints."""
    given = ctx.find_root().params.get("app")
    app = getattr(ctx.obj, "app", None)
    name = given if isinstance(given, str) and given else getattr(app, "main", None)
    return f"celery -A {name or '<app>'}"


def store_of(ctx: click.Context) -> Store:
    """The store those settings name."""
    return store_for(config_of(ctx))


def scope_of(ctx: click.Context) -> Scope:
    """The settings of the app's every fenced task (its task modules imported first), to read
    each job with its own task's database, Redis, key prefix and thresholds."""
    app = ctx.obj.app
    app.loader.import_default_modules()
    return Scope(app)


def locate(scope: Scope, key: str) -> tuple[Store, JobRecord]:
    """The job with ``key`` and the store of the database it is in; one line when it is in none,
    or in more than one (name the task's database then)."""
    found = [(db, record) for db in scope.databases() if (record := db.store.get(key)) is not None]
    if not found:
        raise FenceCLIError(f"no job with key {key!r}")
    if len(found) > 1:
        where = ", ".join(safe_url(db.url) for db, _ in found)
        raise FenceCLIError(
            f"key {key!r} is a job in {len(found)} databases ({where}): resolve it there"
        )
    database, record = found[0]
    return database.store, record


def safe_url(url: str) -> str:
    """``url`` with its password hidden, fit for a message."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<invalid url>"


def utc(value: dt.datetime) -> dt.datetime:
    """``value`` as an aware UTC time (SQLite hands back naive UTC)."""
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value


def utc_text(value: dt.datetime | None) -> str:
    """An ISO 8601 UTC time to the second, or ``-``."""
    if value is None:
        return "-"
    if value.tzinfo is None:  # SQLite hands back naive UTC
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


def utc_iso(value: dt.datetime | None) -> str | None:
    """An ISO 8601 UTC time to the second, or ``None`` (for JSON)."""
    return None if value is None else utc_text(value)


def record_json(record: JobRecord) -> dict[str, Any]:
    """A job as the ``--json`` outputs show it."""
    return {
        "key": record.key,
        "task": record.task_name,
        "status": record.status,
        "never_claimed": never_claimed(record),
        "generation": record.generation,
        "attempt_id": record.attempt_id,
        "attempts": record.attempts,
        "error_type": record.error_type,
        "error_message": record.error_message,
        "created_at": utc_iso(record.created_at),
        "updated_at": utc_iso(record.updated_at),
        "finished_at": utc_iso(record.finished_at),
        "retry_at": utc_iso(record.retry_at),
        "unique_key": record.unique_key,
    }


def effect_json(row: OutboxRow) -> dict[str, Any]:
    """An outbox effect as the ``--json`` outputs show it: its delivery state, never its payload
    (what a handler sends may be personal data; it stays in the table)."""
    return {
        "id": row.id,
        "key": row.key,
        "name": row.name,
        "status": row.status,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "idempotency_key": row.idempotency_key,
        "available_at": utc_iso(row.available_at),
        "created_at": utc_iso(row.created_at),
        "delivered_at": utc_iso(row.delivered_at),
    }


#: Columns of an effect in a text table (``fence show``, ``fence outbox ls``).
EFFECT_HEADER = ("ID", "NAME", "STATUS", "ATTEMPTS", "NEXT TRY", "LAST ERROR", "IDEMPOTENCY KEY")
#: Characters of an effect's last error a text table shows (``--json`` has it whole).
EFFECT_ERROR_LENGTH = 80


def effect_cells(row: OutboxRow) -> tuple[str, ...]:
    """An outbox effect as a row of :data:`EFFECT_HEADER` (no payload)."""
    error = " ".join((row.last_error or "-").split())
    if len(error) > EFFECT_ERROR_LENGTH:
        error = error[: EFFECT_ERROR_LENGTH - 3] + "..."
    due = utc_text(row.available_at) if row.status == "pending" else "-"
    return (str(row.id), row.name, row.status, str(row.attempts), due, error, row.idempotency_key)


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Left-aligned columns under ``header``, two spaces apart."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)).rstrip()
        for line in lines
    )


def command(name: str) -> Callable[[Callable[..., Any]], click.Command]:
    """Register a verb on ``fence`` (Celery's command class, so the app options apply)."""
    return fence.command(name=name, cls=CeleryCommand)
