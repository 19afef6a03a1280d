"""Fenced steps and checkpoints under real workers (tests/acceptance/test_steps_workers.py):
tasks of the acceptance app (``tests.support.app``), loaded with ``--include``.

Ledger (Redis, ``<prefix>:...``), what really happened, whatever the store says:
``step_runs:<key>``    one entry per step body run, ``<step>:<generation>`` (an external effect)
``hung:<key>``         the step a body hangs in (flag ``hang:<key>:<step>``, until ``unhang:<key>``)
``resumed:<key>``      the step a hung body went on with
``export_work:<key>``  one entry per batch an export started, ``<start>:<end>``
Tables (the store's database): ``t_saga_effects`` one row per committed step write,
``t_export_rows`` one row per exported row.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_fence import FencedTask
from celery_fence.testing import faults
from tests.support.app import PREFIX, _hang, app, app_engine, ledger

metadata = sa.MetaData()
saga_effects = sa.Table(
    "t_saga_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
)
exported = sa.Table(
    "t_export_rows",
    metadata,
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("row_id", sa.Integer, nullable=False),
)
_created = False


def _tables() -> None:
    global _created
    if not _created:
        metadata.create_all(app_engine())
        _created = True


def _saga_step(fence: Any, key: str, n: int, *, fenced: bool) -> dict[str, int]:
    ledger.rpush(f"{PREFIX}:step_runs:{key}", f"{n}:{fence.generation}")
    if faults.take(ledger, PREFIX, "hang", key, str(n)):
        ledger.rpush(f"{PREFIX}:hung:{key}", str(n))
        _hang(key)
        ledger.rpush(f"{PREFIX}:resumed:{key}", str(n))
    row = {"key": key, "step": n, "generation": fence.generation}
    if fenced:  # joins the step's own transaction
        with fence.transaction() as conn:
            conn.execute(saga_effects.insert().values(**row))
    else:  # the control arm: plain code, a plain write
        with app_engine().begin() as conn:
            conn.execute(saga_effects.insert().values(**row))
    return {"step": n, "generation": fence.generation}


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def saga(self: Any, key: str, *, steps: int = 3, fenced: bool = True) -> list[Any]:
    """``steps`` steps, each an external effect (the ledger) and a write; ``fenced`` False: the
    same code without steps (the control arm)."""
    _tables()
    fence = self.fence
    done = []
    for n in range(1, steps + 1):
        if fenced:
            done.append(fence.run_step(f"step{n}", _saga_step, fence, key, n, fenced=True))
        else:
            done.append(_saga_step(fence, key, n, fenced=False))
    return done


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def export(self: Any, key: str, *, rows: int, batch: int, checkpoint: bool = True) -> int:
    """Export rows ``0..rows-1`` in batches, each batch and its checkpoint one fenced block;
    ``checkpoint`` False: the same without a checkpoint (the control arm: starts from zero)."""
    _tables()
    fence = self.fence
    start = int((fence.progress or {}).get("next", 0)) if checkpoint else 0
    while start < rows:
        end = min(start + batch, rows)
        ledger.rpush(f"{PREFIX}:export_work:{key}", f"{start}:{end}")
        with fence.transaction() as conn:
            conn.execute(exported.insert(), [{"key": key, "row_id": i} for i in range(start, end)])
            if checkpoint:
                fence.checkpoint({"next": end})
        start = end
    return rows
