"""The README's settings table names every setting FenceConfig reads, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from celery_fence.settings import FIELD_NAMES

README = Path(__file__).resolve().parents[2] / "README.md"


def _documented_settings() -> set[str]:
    text = README.read_text()
    table = text[text.index("## Settings") :]
    table = table[: table.index("\n## ")]
    names: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `fence_"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`fence_(\w+)`", first_cell))
    return names


def test_the_settings_table_is_the_config() -> None:
    assert _documented_settings() == set(FIELD_NAMES)
