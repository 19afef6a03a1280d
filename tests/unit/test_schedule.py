"""The xdist order (tests/support/schedule.py): the slow tests head the processes' slices."""

from __future__ import annotations

from tests.support.schedule import longest_first, slice_sizes

SLOW = {"c": 100.0, "f": 90.0, "h": 60.0, "i": 20.0}


def test_the_slices_are_the_ones_worksteal_hands_out() -> None:
    assert slice_sizes(9, 2) == [4, 5]
    assert slice_sizes(10, 3) == [3, 3, 4]
    assert slice_sizes(1, 2) == [0, 1]


def test_each_slice_starts_with_its_share_of_the_slow_tests_longest_first() -> None:
    items = list("abcdefghij")
    ordered = longest_first(items, SLOW.get, 2)
    assert sorted(ordered) == items  # nothing lost, nothing twice
    first, second = ordered[:5], ordered[5:]
    # the longest to the first slice, the next to the other, then to the lighter one (90 < 100)
    assert first[:2] == ["c", "i"] and second[:2] == ["f", "h"]
    # the others keep their collection order, filling the slices up to worksteal's sizes
    assert first[2:] + second[2:] == ["a", "b", "d", "e", "g", "j"]


def test_a_full_slice_takes_no_more_slow_tests() -> None:
    # slices of 2: "c" would go to the lighter second slice, which is full
    ordered = longest_first(list("abcd"), {"a": 1.0, "b": 1.0, "c": 1.0, "d": 10.0}.get, 2)
    assert ordered == ["d", "c", "a", "b"]


def test_one_process_or_no_slow_test_keeps_the_order_of_the_rest() -> None:
    none: dict[str, float] = {}
    assert longest_first(list("abc"), none.get, 2) == list("abc")
    assert longest_first(list("abcd"), {"d": 5.0}.get, 1) == list("dabc")
