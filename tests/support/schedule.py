"""The order the xdist processes get the tests in: the long ones first, spread over the processes.

``pytest -n N --dist worksteal`` hands process *i* the *i*-th of N consecutive slices of the
collection, then lets an idle process take the second half of another's remaining tests. A long
test near the end of a slice starts last and leaves the other processes idle while it runs. So
the tests marked ``slow(seconds)`` go to the head of the slices, longest first, each to the slice
with the fewest slow seconds so far; every other test keeps its place in collection order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice
from typing import TypeVar

T = TypeVar("T")


def slice_sizes(total: int, workers: int) -> list[int]:
    """How many tests each process gets first: worksteal's split (remaining // processes left)."""
    sizes = []
    remaining = total
    for left in range(workers, 0, -1):
        sizes.append(remaining // left)
        remaining -= sizes[-1]
    return sizes


def longest_first(
    items: Sequence[T], seconds: Callable[[T], float | None], workers: int
) -> list[T]:
    """``items`` reordered so each of ``workers`` slices starts with its share of the slow ones
    (``seconds(item)`` not None), longest first; the others follow in their order."""
    slow = sorted((i for i in items if seconds(i) is not None), key=lambda i: -(seconds(i) or 0))
    rest = iter([i for i in items if seconds(i) is None])
    sizes = slice_sizes(len(items), workers)
    heads: list[list[T]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for item in slow:
        room = [s for s in range(len(sizes)) if len(heads[s]) < sizes[s]]
        chosen = min(room, key=lambda s: (load[s], s))
        heads[chosen].append(item)
        load[chosen] += seconds(item) or 0
    ordered: list[T] = []
    for head, size in zip(heads, sizes, strict=True):
        ordered += head
        ordered += islice(rest, size - len(head))
    return ordered
