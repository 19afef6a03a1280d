"""Tables printed as Markdown, so a run's output pastes straight into the README."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """A Markdown table: first column left-aligned, the others right-aligned."""
    text = [[str(h) for h in headers]] + [[cell(v, digits) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(
            (":" + "-" * (w + 1)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(text[0]), rule, *(line(r) for r in text[1:])])
