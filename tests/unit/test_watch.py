"""The write watch's cheap path and its setting (issue 31 items 1 and 6; issue 33: the
engine-wide listeners cost nothing while no fenced body runs)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_fence.body import sqla, watch
from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError


class Untouchable:
    """A connection the listeners must not look at: any attribute read fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the idle path read conn.{name}")


def test_no_fenced_body_running_the_listeners_touch_nothing() -> None:
    assert watch.WATCH.idle and watch.current_attempt() is None
    conn: Any = Untouchable()
    sqla._on_begin(conn)
    sqla._before_statement(conn, None, "UPDATE t SET x = 1", (), None, False)
    sqla._after_statement(conn, None, "UPDATE t SET x = 1", (), None, False)
    sqla._on_commit(conn)

    class Context:
        connection = conn

    sqla._on_error(Context())


def test_bookkeeping_nests_and_ends() -> None:
    assert not watch.in_bookkeeping()
    with watch.bookkeeping():
        with watch.bookkeeping():
            assert watch.in_bookkeeping()
        assert watch.in_bookkeeping()
    assert not watch.in_bookkeeping()


@pytest.mark.parametrize("mode", ["warn", "error", "allow"])
def test_fence_unfenced_writes_takes_its_three_values(mode: str) -> None:
    assert FenceConfig.from_mapping({"fence_unfenced_writes": mode}).unfenced_writes == mode
    assert FenceConfig().unfenced_writes == "warn"
    assert FenceConfig.from_mapping({"FENCE_UNFENCED_WRITES": " Error "}).unfenced_writes == "error"


@pytest.mark.parametrize("bad", ["warning", "", "no", 1, True])
def test_a_bad_fence_unfenced_writes_is_a_clear_error(bad: Any) -> None:
    with pytest.raises(
        ConfigurationError, match=r"fence_unfenced_writes=.*'warn'.*'error'.*'allow'"
    ):
        FenceConfig.from_mapping({"fence_unfenced_writes": bad})
