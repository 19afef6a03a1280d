"""Every breakage of the mutation check still applies to the package as it is, and leaves code
that compiles: a breakage whose text drifted would show only when someone runs the check (as
"not applied", or as a harness that cannot import the broken copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_fence.chaos.checker import SAFETY_COLUMNS
from tests import mutations


@pytest.mark.parametrize("breakage", mutations.BREAKAGES, ids=lambda b: b.name)
def test_each_breakage_applies_to_the_current_code(
    breakage: mutations.Breakage, tmp_path: Path
) -> None:
    assert mutations.mutant(tmp_path, breakage), (
        f"{breakage.name}: its text is no longer in {breakage.path}; update it in mutations.py"
    )
    broken = tmp_path / "celery_fence" / breakage.path
    if broken.suffix == ".py":  # (a Lua script is checked by the run itself)
        compile(broken.read_text(), str(broken), "exec")  # a SyntaxError names the file


def test_a_breakage_counts_as_caught_only_by_the_column_it_names() -> None:
    # Given a breakage that names "stale writes accepted" and a run where another column fired,
    run = mutations.MutationRun(
        "guard",
        "guard() unchecked",
        "pause",
        True,
        {"unexpected_outcomes": 2},
        "",
        1,
        1.0,
        expected="stale_writes",
    )
    # then it is not caught; once its own column fires, it is.
    assert not run.caught
    run.fired["stale_writes"] = 1
    assert run.caught


def test_every_breakage_names_a_safety_column_and_the_new_paths_are_broken() -> None:
    for b in mutations.BREAKAGES:
        assert b.column in SAFETY_COLUMNS, (b.name, b.column)
    paths = {b.path for b in mutations.BREAKAGES}
    # the guard, atomic(), enqueue, recovery and outbox delivery each have a breakage
    assert {
        "body/fence.py",
        "contrib/django/atomic.py",
        "durable/__init__.py",
        "ops/recovery.py",
    } <= paths, paths
    assert any(b.name == "outbox-claim" for b in mutations.BREAKAGES)
