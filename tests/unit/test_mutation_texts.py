"""Every breakage of the mutation check still applies to the package as it is, and leaves code
that compiles: a breakage whose text drifted would show only when someone runs the check (as
"not applied", or as a harness that cannot import the broken copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_fence.chaos import mutations


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
