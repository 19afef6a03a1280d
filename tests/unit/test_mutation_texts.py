"""Every breakage of the mutation check still applies to the package as it is: a breakage whose
text the code no longer contains would report "not applied" only when someone runs the check."""

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
