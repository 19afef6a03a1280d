"""The verbs that change state: ``init-db``, ``requeue``, ``recover`` and ``purge``."""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import time
from collections.abc import Callable

import click
from celery.bin.base import CeleryOption

from celery_fence import migrate
from celery_fence.actions import Action
from celery_fence.announce.transitions import emit_transition
from celery_fence.ops import recovery
from celery_fence.ops.cli.common import (
    EX_USAGE,
    FenceCLIError,
    command,
    describe,
    locate,
    safe_url,
    scope_of,
    utc_text,
)
from celery_fence.ops.requeue import SendFailed, requeue_finished
from celery_fence.ops.scope import Scope
from celery_fence.schema import COMPLETED, DEAD
from celery_fence.settings import MIN_RETENTION
from celery_fence.store import JobRecord, Store
from celery_fence.store.admin import PURGE_BATCH

# -- init-db -----------------------------------------------------------------------------------


@command("init-db")
@click.pass_context
def init_db(ctx: click.Context) -> None:
    """Create or upgrade the celery-fence tables (Alembic; stamps tables made by create_all) in
    every database the app's fenced tasks use."""
    with scope_of(ctx) as scope:
        urls = [database.url for database in scope.databases()]
    for url in urls:
        action = migrate.upgrade(url)
        ctx.obj.echo(f"{action}: celery-fence schema at {safe_url(url)} is at {migrate.head()}")


# -- requeue, recover ----------------------------------------------------------------------------


@command("requeue")
@click.argument("key")
@click.option(
    "--force",
    cls=CeleryOption,
    is_flag=True,
    help_group="Requeue Options",
    help="Also re-send a job that is not dead (running, retrying, pending) once no live lease "
    "holds it; its attempt count is kept.",
)
@click.option(
    "--completed",
    cls=CeleryOption,
    is_flag=True,
    help_group="Requeue Options",
    help="Run a completed job again, on purpose (its data was fixed): the stored result stays "
    "until the new attempt's completion replaces it; the history records the re-run.",
)
@click.pass_context
def requeue(ctx: click.Context, key: str, force: bool, completed: bool) -> None:
    """Re-send a dead job (same key, fresh attempt budget) to its queue.

    With --force, also an unfinished job that no live lease holds (a stranded one, without
    waiting for 'fence recover'). A completed job is re-sent only with --completed.
    """
    if force and completed:
        raise FenceCLIError("--force and --completed do not go together", exit_code=EX_USAGE)
    app = ctx.obj.app
    with scope_of(ctx) as scope:
        store, record = locate(scope, key)
        wanted = COMPLETED if completed else DEAD
        if record.status != wanted:
            if record.status == COMPLETED:
                raise FenceCLIError(
                    f"job {key!r} is completed: its stored result is replayed to every delivery; "
                    "to run it again on purpose, add --completed (or give the new work a new key, "
                    "e.g. with a version in it)"
                )
            if completed or not force or record.status == DEAD:
                raise FenceCLIError(
                    f"job {key!r} is {record.status}, not {wanted}: not requeued"
                    + ("" if record.status == DEAD else " (--force re-sends an unfinished one)")
                )
            _force_requeue(ctx, scope, store, record)
            return
    reason = "completed job re-run by operator" if completed else "requeued by operator"
    try:
        done = requeue_finished(app, store, key, completed=completed, reason=reason)
    except recovery.NotResendable as exc:
        raise FenceCLIError(str(exc)) from None
    except SendFailed as failed:
        if not failed.restored:
            raise FenceCLIError(
                f"could not confirm the send of {key!r} ({describe(failed.cause)}), and an "
                "attempt has claimed it since: left as it is"
            ) from None
        raise FenceCLIError(
            f"could not send {key!r} ({describe(failed.cause)}); it is {failed.record.status} "
            "again, retry the requeue"
        ) from None
    _requeued(ctx, done.record, done.task_id)


def _force_requeue(ctx: click.Context, scope: Scope, store: Store, record: JobRecord) -> None:
    remaining, generation = scope.lease(record)  # under the job's own task's Redis and prefix
    if remaining is not None:
        raise FenceCLIError(
            f"job {record.key!r} is {record.status} and a live lease holds it ({remaining:.1f}s "
            f"left, generation {generation}): it is running; not re-sent"
        )
    try:
        task_id = recovery.resend(ctx.obj.app, store, record, reason="forced requeue by operator")
    except recovery.NotResendable as exc:
        raise FenceCLIError(str(exc)) from None
    except Exception as exc:
        raise FenceCLIError(
            f"could not send {record.key!r} ({describe(exc)}); it is pending: retry the requeue, "
            f"or 'fence recover' sends it after {scope.config_of(record).recover_after_seconds:g}s"
        ) from None
    if task_id is None:
        raise FenceCLIError(f"job {record.key!r} changed while it was requeued: look again")
    task_name = str((record.request or {}).get("task") or record.task_name)
    emit_transition(  # the transition the store recorded for it
        Action.RECOVERED,
        ctx.obj.app.tasks.get(task_name, task_name),
        key=record.key,
        attempt_id=None,
        generation=record.generation,
        reason="forced requeue by operator",
        countdown=0.0,
        attempts=record.attempts,
    )
    _requeued(ctx, record, task_id)


def _requeued(ctx: click.Context, record: JobRecord, task_id: str) -> None:
    """Say where the re-send went."""
    app = ctx.obj.app
    task_name = str((record.request or {}).get("task") or record.task_name)
    routing = recovery.routing_for(record, app)
    where = (
        f"exchange {routing['exchange']} with routing key {routing['routing_key']}"
        if "routing_key" in routing
        else f"queue {routing.get('queue') or '(routed)'}"
    )
    ctx.obj.echo(f"requeued {record.key}: {task_name} sent to {where} as {task_id}")


@command("recover")
@click.option(
    "--older-than",
    cls=CeleryOption,
    type=click.FloatRange(min=0),
    default=None,
    help_group="Recover Options",
    help="Seconds an unfinished job must not have moved (default: none for a running job, "
    "whose lease alone decides; each job's task's fence_recover_after, 3 x its lease TTL, for "
    "a retrying or re-sent one; fence_recover_pending_after, 60, for a job enqueued and never "
    "claimed).",
)
@click.option(
    "--dry-run",
    cls=CeleryOption,
    is_flag=True,
    help_group="Recover Options",
    help="Only list what would be re-sent.",
)
@click.option(
    "--limit",
    cls=CeleryOption,
    type=click.IntRange(min=1),
    default=recovery.DEFAULT_LIMIT,
    show_default=True,
    help_group="Recover Options",
    help="At most this many jobs in one run.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
@click.pass_context
def recover(
    ctx: click.Context, older_than: float | None, dry_run: bool, limit: int, as_json: bool
) -> None:
    """Re-send stranded jobs (unfinished, no live lease, not moved) under their own key.

    Each is taken by a compare-and-set before its send (two runs never both send it) and goes
    through the ordinary claim (a late original message cannot make a second completion).
    Exits 1 when a job could not be re-sent.
    """
    ctx.obj.app.loader.import_default_modules()  # each job is judged with its task's settings
    report = recovery.recover(ctx.obj.app, older_than=older_than, dry_run=dry_run, limit=limit)
    if as_json:
        ctx.obj.echo(
            json.dumps(
                {
                    **report.as_dict(),
                    "keys": {
                        "stranded": report.stranded,
                        "sent": report.sent,
                        "raced": report.raced,
                        "dead": report.dead,
                        "failed": report.failed,
                    },
                }
            )
        )
    else:
        for key in report.stranded:
            state = (
                "would re-send"
                if dry_run
                else "re-sent"
                if key in report.sent
                else "moved meanwhile, left"
                if key in report.raced
                else "no stored request: now dead"
                if key in report.dead
                else "FAILED"
            )
            ctx.obj.echo(f"{key}: {state}")
        verb = "would re-send" if dry_run else "re-sent"
        count = len(report.stranded) if dry_run else len(report.sent)
        ctx.obj.echo(f"{len(report.stranded)} stranded job(s); {verb} {count}")
    if report.failed:
        raise FenceCLIError(
            f"{len(report.failed)} stranded job(s) could not be re-sent (see the log): "
            + ", ".join(report.failed[:5])
        )


# -- purge ---------------------------------------------------------------------------------------

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_before(value: str, now: dt.datetime | None = None) -> dt.datetime:
    """An ISO 8601 date or date-time (naive means UTC), or an age like ``30d``, ``12h``."""
    text = value.strip()
    age = _AGE.match(text)
    if age:
        seconds = float(age.group(1)) * _UNITS[age.group(2)]
        return (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(seconds=seconds)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FenceCLIError(
            f"bad date {value!r}: use ISO 8601 (2024-05-01 or 2024-05-01T12:00:00+00:00) or an "
            "age (30d, 12h, 45m)",
            exit_code=EX_USAGE,
        ) from None
    if when.tzinfo is None:
        return when.replace(tzinfo=dt.timezone.utc)
    return when.astimezone(dt.timezone.utc)  # stored times are UTC (SQLite compares text)


def _progress_from(progress: Callable[[int], None], base: int, total: int) -> None:
    """``progress`` of a purge across databases: this database's count on top of ``base``."""
    progress(base + total)


#: Seconds between two progress lines of a long purge.
PROGRESS_EVERY = 2.0


@command("purge")
@click.option(
    "--completed-before",
    "before",
    cls=CeleryOption,
    required=True,
    help_group="Purge Options",
    help="Delete jobs finished before this date (ISO 8601, naive = UTC) or age (30d).",
)
@click.option(
    "--include-dead",
    cls=CeleryOption,
    is_flag=True,
    help_group="Purge Options",
    help="Also delete dead jobs finished before the date (kept by default for inspection).",
)
@click.option(
    "--batch-size",
    cls=CeleryOption,
    type=click.IntRange(min=1),
    default=PURGE_BATCH,
    show_default=True,
    help_group="Purge Options",
    help="Jobs deleted (with their history) in one transaction.",
)
@click.option(
    "--force",
    cls=CeleryOption,
    is_flag=True,
    help_group="Purge Options",
    help=f"Allow a date less than {MIN_RETENTION / 3600:g} hour(s) ago (the retention floor): "
    "a purged key runs again as new work when it is sent again.",
)
@click.pass_context
def purge(
    ctx: click.Context, before: str, include_dead: bool, batch_size: int, force: bool
) -> None:
    """Delete finished jobs and their history, and outbox rows delivered before the date.

    Oldest first, in batches of one short transaction each: safe to stop (Ctrl-C) and run
    again, it goes on where it was; progress goes to stderr every few seconds. Outbox rows are
    written when a job completes, so a row delivered before the date belongs to a job completed
    before it; rows not delivered yet (pending, dead) are kept whatever their age.

    A date less than an hour ago (``fence_retention``'s floor) needs ``--force``: a completed
    job's row is what replays its result to a late redelivery; once purged, the key runs again
    as new work (its outbox effects with the same idempotency keys as its first run's).
    """
    when = parse_before(before)
    floor = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=MIN_RETENTION)
    if when > floor and not force:
        raise FenceCLIError(
            f"--completed-before {before} is less than {MIN_RETENTION / 3600:g} hour(s) ago "
            "(the retention floor, as fence_retention): a purged key that is sent again runs "
            "as new work, so a late redelivery would run its body again; pick an older date, "
            "or add --force to purge it anyway",
            exit_code=EX_USAGE,
        )
    statuses = (COMPLETED, DEAD) if include_dead else (COMPLETED,)
    started = shown = time.monotonic()

    def progress(total: int) -> None:
        nonlocal shown
        if time.monotonic() - shown >= PROGRESS_EVERY:
            shown = time.monotonic()
            rate = total / max(shown - started, 1e-9)
            click.echo(f"purge: {total} job(s) deleted so far ({rate:.0f}/s)", err=True)

    count = delivered = 0
    with scope_of(ctx) as scope:
        for database in scope.databases():
            count += database.store.admin.purge(
                finished_before=when,
                statuses=statuses,
                batch_size=batch_size,
                progress=functools.partial(_progress_from, progress, count),
            )
            delivered += database.store.outbox_rows.purge(delivered_before=when)
    ctx.obj.echo(
        f"purged {count} {' and '.join(statuses)} job(s) finished and {delivered} outbox row(s) "
        f"delivered before {utc_text(when)}"
    )
