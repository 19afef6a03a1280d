"""The fenced statements of store/queries.sql: each named once, its fence readable in its SQL, and
the control arms' statements theirs (each differs from the product's where it must)."""

from __future__ import annotations

import pytest

from celery_fence.chaos import arms
from celery_fence.store import queries

DIALECTS = ("postgresql", "sqlite")
#: Every name the store runs, for both dialects.
USED = (
    "register",
    *arms.OWNER_ENDINGS,
    "dead_refused",
    "dead_unregistered",
    "dead_unregistered_new",
    "dead_unrun",
    "dead_stranded",
    "requeue",
    "requeue_rerun",
    "restore_finished",
    "take_for_resend",
    "step_done",
    "checkpoint",
    "transition",
)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_statement_the_store_runs_is_named_for_the_dialect(dialect: str) -> None:
    rendered = queries.STATEMENTS.rendered(dialect)
    assert set(USED) <= set(rendered), set(USED) - set(rendered)
    if dialect == "postgresql":
        assert {"with_transition", "with_effects", "durable_commit", "async_commit"} <= set(
            rendered
        )
        assert all(":" + "key" not in text for text in rendered.values())  # all %(name)s
    else:
        assert {"outbox_insert", "clear_steps", "sync_ending", "sync_default"} <= set(rendered)
        assert all("::jsonb" not in text for text in rendered.values())


def test_the_endings_of_a_running_attempt_say_the_fence_in_their_sql() -> None:
    for name in (*arms.OWNER_ENDINGS, "step_done", "checkpoint"):
        assert queries.OWNED in queries.STATEMENTS.template(name, "sqlite"), name
    for dialect in DIALECTS:
        assert queries.NEWER_LIVE in queries.STATEMENTS.template("register", dialect)
        assert queries.NEWER_LIVE in queries.STATEMENTS.template("dead_refused", dialect)


def test_the_control_arms_statements_differ_from_the_products() -> None:
    # Given the --unfenced arm's statements, each ending and the registration is its own text
    for dialect in DIALECTS:
        product, unfenced = (
            queries.STATEMENTS.rendered(dialect),
            arms.UNFENCED_STATEMENTS.rendered(dialect),
        )
        for name in (*arms.OWNER_ENDINGS, "register"):
            assert unfenced[name] != product[name], (dialect, name)
            assert (
                "generation = :generation"
                not in arms.UNFENCED_STATEMENTS.template(name, dialect)
                .split("WHERE", 1)[-1]
                .split("RETURNING")[0]
            )
        assert "generation = %(generation)s" in unfenced["complete"] or dialect == "sqlite"
        # the rest is the product's
        assert unfenced["step_done"] == product["step_done"]
    # and the --async-endings arm's endings commit as the registration does.
    pg = arms.ASYNC_ENDINGS_STATEMENTS.rendered("postgresql")
    assert pg["durable_commit"] == pg["async_commit"]
    assert arms.ASYNC_ENDINGS_STATEMENTS.rendered("sqlite")["sync_ending"] == (
        "PRAGMA synchronous=NORMAL"
    )


def test_a_statements_file_names_each_statement_once() -> None:
    text = "-- name: a\nSELECT 1\n-- a comment\n\n-- name: a (sqlite)\nSELECT 2\n"
    assert queries.parse_statements(text) == {("a", None): "SELECT 1", ("a", "sqlite"): "SELECT 2"}
    with pytest.raises(ValueError, match="'a' given twice"):
        queries.parse_statements(text + "-- name: a\nSELECT 3\n")
    with pytest.raises(ValueError, match="'b' has no text"):
        queries.parse_statements("-- name: b\n-- only a comment\n")
    with pytest.raises(KeyError, match="no statement 'c'"):
        queries.Statements(queries.parse_statements(text)).template("c", "sqlite")
