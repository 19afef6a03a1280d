"""``fence beat``: the fenced beat scheduler's record (:mod:`celery_fence.beat`) — ``ls``, the
last tick each entry fired (its scheduled time and its job's key), and the entries of the app's
``beat_schedule`` that never fired."""

from __future__ import annotations

import json

import click
from celery.bin.base import CeleryCommand

from celery_fence.ops.cli.common import FenceGroup, fence, store_of, table, utc_iso, utc_text
from celery_fence.store import BeatTick


@fence.group(name="beat", cls=FenceGroup)
@click.pass_context
def beat(ctx: click.Context) -> None:
    """The fenced beat scheduler (celery beat -S celery_fence.beat:Scheduler): its ticks."""


@beat.command(name="ls", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_context
def ls(ctx: click.Context, as_json: bool) -> None:
    """List each beat entry's last fired tick: the entry, its scheduled time (UTC), the fence
    key of its job and when a replica recorded it. Entries of the app's beat_schedule that
    never fired show '-'."""
    rows: dict[str, BeatTick | None] = {t.entry: t for t in store_of(ctx).beat_ticks.rows()}
    for name in ctx.obj.app.conf.beat_schedule or {}:
        rows.setdefault(name, None)
    if as_json:
        ctx.obj.echo(
            json.dumps(
                [
                    {
                        "entry": name,
                        "last_scheduled": utc_iso(t.last_scheduled) if t else None,
                        "key": t.key if t else None,
                        "recorded_at": utc_iso(t.updated_at) if t else None,
                    }
                    for name, t in sorted(rows.items())
                ]
            )
        )
        return
    if not rows:
        ctx.obj.echo("no beat entries")
        return
    header = ("ENTRY", "LAST TICK", "KEY", "RECORDED")
    cells = [
        (name, utc_text(t.last_scheduled), t.key, utc_text(t.updated_at))
        if t
        else (name, "-", "-", "-")
        for name, t in sorted(rows.items())
    ]
    ctx.obj.echo(table(cells, header))
