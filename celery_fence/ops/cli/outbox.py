"""``fence outbox``: the outbox's effects for operators — ``ls`` (their delivery state, never
their payloads) and ``requeue`` (a ``dead`` effect back to ``pending``, delivered by the next
sender with a fresh attempt budget)."""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption

from celery_fence.ops.cli.common import (
    EFFECT_HEADER,
    EX_USAGE,
    FenceCLIError,
    FenceGroup,
    effect_cells,
    effect_json,
    fence,
    safe_url,
    scope_of,
    table,
    utc,
)
from celery_fence.schema import OutboxStatus
from celery_fence.store import OutboxRow

DEAD = OutboxStatus.DEAD.value


@fence.group(name="outbox", cls=FenceGroup)
@click.pass_context
def outbox(ctx: click.Context) -> None:
    """The outbox's effects: list them, requeue dead ones."""


@outbox.command(name="ls", cls=CeleryCommand)
@click.option(
    "--dead",
    cls=CeleryOption,
    is_flag=True,
    help_group="Filter Options",
    help="Only effects whose delivery gave up (dead): what 'fence outbox requeue' takes.",
)
@click.option("--key", cls=CeleryOption, help_group="Filter Options", help="Only this job's.")
@click.option(
    "--limit",
    cls=CeleryOption,
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help_group="Filter Options",
    help="At most this many effects, newest first.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_context
def ls(ctx: click.Context, dead: bool, key: str | None, limit: int, as_json: bool) -> None:
    """List outbox effects, newest first: id, job key, name, state, attempts, when the next
    delivery is due, the last error and the idempotency key. Payloads are never shown."""
    status = DEAD if dead else None
    with scope_of(ctx) as scope:
        found: list[OutboxRow] = [
            row
            for database in scope.databases()
            for row in database.store.outbox_rows.rows(
                key=key, status=status, limit=limit, newest_first=True
            )
        ]
    rows = sorted(found, key=lambda r: (utc(r.created_at), r.id), reverse=True)[:limit]
    if len(rows) == limit:  # on stderr, so --json stays one array
        click.echo(f"fence outbox ls: {limit} shown (--limit); more may match", err=True)
    if as_json:
        ctx.obj.echo(json.dumps([effect_json(r) for r in rows]))
        return
    if not rows:
        ctx.obj.echo("no dead effects" if dead else "no effects")
        return
    header = (EFFECT_HEADER[0], "KEY", *EFFECT_HEADER[1:])
    ctx.obj.echo(table([(c[0], r.key, *c[1:]) for r in rows for c in [effect_cells(r)]], header))


@outbox.command(name="requeue", cls=CeleryCommand)
@click.argument("ids", nargs=-1, type=int)
@click.option(
    "--dead",
    "all_dead",
    cls=CeleryOption,
    is_flag=True,
    help_group="Requeue Options",
    help="Requeue every dead effect (with --key: that job's) instead of the IDs given.",
)
@click.option(
    "--key",
    cls=CeleryOption,
    help_group="Requeue Options",
    help="With --dead: only this job's dead effects.",
)
@click.pass_context
def requeue(ctx: click.Context, ids: tuple[int, ...], all_dead: bool, key: str | None) -> None:
    """Put dead effects back to pending, due now, with a fresh attempt budget: the next sender
    (the deliver task, the sweep) delivers them with their own idempotency keys.

    One conditional statement per database: only rows that are still dead change. An effect
    named that is not dead (pending, delivered) is left as it is and said (exit 1); an unknown
    ID fails the command before anything changes.
    """
    if all_dead == bool(ids):
        raise FenceCLIError(
            "give the IDs of dead effects (see 'fence outbox ls --dead'), or --dead for all of "
            "them, not both",
            exit_code=EX_USAGE,
        )
    if key is not None and not all_dead:
        raise FenceCLIError("--key goes with --dead", exit_code=EX_USAGE)
    with scope_of(ctx) as scope:
        stores = [database.store for database in scope.databases()]
        if all_dead:
            moved = [i for store in stores for i in store.outbox_rows.requeue_dead(key=key)]
            ctx.obj.echo(_requeued(moved))
            return
        wanted = sorted(set(ids))
        where: dict[int, list[Any]] = {}
        statuses: dict[int, str] = {}
        for store in stores:
            for row_id, status in store.outbox_rows.statuses(wanted).items():
                where.setdefault(row_id, []).append(store)
                statuses[row_id] = status
        unknown = [i for i in wanted if i not in where]
        if unknown:
            raise FenceCLIError(
                f"no outbox effect with id {', '.join(map(str, unknown))}: nothing requeued "
                "(see 'fence outbox ls')"
            )
        ambiguous = [i for i in wanted if len(where[i]) > 1]
        if ambiguous:
            places = ", ".join(safe_url(s.url) for s in where[ambiguous[0]])
            raise FenceCLIError(
                f"outbox effect id {', '.join(map(str, ambiguous))} is in more than one database "
                f"({places}): nothing requeued; requeue them with the task's own app, or --dead"
            )
        moved = []
        for store in stores:
            mine = [i for i in wanted if where[i][0] is store]
            moved += store.outbox_rows.requeue_many(mine)
        now = {}
        left = [i for i in wanted if i not in moved]
        if left:  # not dead when the statement ran: say what they are now
            for store in stores:
                now.update(store.outbox_rows.statuses([i for i in left if where[i][0] is store]))
    ctx.obj.echo(_requeued(sorted(moved)))
    if left:
        raise FenceCLIError(
            "not requeued (only a dead effect is): "
            + ", ".join(f"{i} is {now.get(i, statuses[i])}" for i in left)
        )


def _requeued(moved: list[int]) -> str:
    if not moved:
        return "requeued 0 outbox effects"
    shown = ", ".join(map(str, moved[:20])) + (", ..." if len(moved) > 20 else "")
    return f"requeued {len(moved)} outbox effect(s): {shown}"
