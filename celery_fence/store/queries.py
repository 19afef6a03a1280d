"""The loader of :file:`queries.sql`, the fenced writes written out and named
(``-- name: complete``): read once at import (:data:`STATEMENTS`), rendered once per dialect
(:func:`render`; each driver runs them as prepared statements its own way,
:meth:`.engine.Database.run_prepared`), so they skip SQLAlchemy's statement building and
compilation, which costs more CPU than the round trip on the two that every task runs. Each
returns ``(key, generation, attempt_id, attempts)`` of the row it changed, or no row when its
condition did not match. :meth:`Rendered.with_records` wraps one in data-modifying CTEs (named
there too) so its transition row and staged outbox rows share its statement."""

from __future__ import annotations

import re
from importlib import resources


def render(dialect: str, template: str) -> str:
    """A ``:name`` template in the dialect's parameter style: ``%(name)s`` on PostgreSQL
    (``::type`` casts kept), which psycopg 3 and psycopg2 both take; as is on SQLite, its
    ``::jsonb`` casts dropped (SQLite keeps JSON as text)."""
    if dialect == "sqlite":
        return template.replace("::jsonb", "")
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", template)


def parse_statements(text: str) -> dict[tuple[str, str | None], str]:
    """The blocks of a ``queries.sql`` text: ``{(name, dialect or None): statement}``. A block
    starts at ``-- name: <name>`` or ``-- name: <name> (<dialect>)`` and runs to the next; its
    ``--`` lines are comments (dropped); a name given twice for one dialect is an error."""
    blocks: dict[tuple[str, str | None], str] = {}
    current: tuple[str, str | None] | None = None
    lines: list[str] = []

    def close() -> None:
        if current is not None:
            body = "\n".join(lines).strip()
            if not body:
                raise ValueError(f"queries.sql: statement {current[0]!r} has no text")
            blocks[current] = body

    for line in text.splitlines():
        header = _NAME_LINE.match(line)
        if header is not None:
            close()
            current, lines = (header["name"], header["dialect"]), []
            if current in blocks:
                raise ValueError(f"queries.sql: statement {current[0]!r} given twice")
        elif current is not None and not line.lstrip().startswith("--"):
            lines.append(line.rstrip())
    close()
    return blocks


_NAME_LINE = re.compile(r"^-- name: (?P<name>\w+)(?: \((?P<dialect>postgresql|sqlite)\))?\s*$")


class Statements:
    """The named fenced statements (:file:`queries.sql`), per dialect. ``rendered(dialect)``
    gives each name's text in that dialect's parameter style, rendered once (the store's
    statement cache); :meth:`replaced` gives a set with some texts replaced (the chaos
    harness's control arms: their statements are theirs, never flags of the product's)."""

    def __init__(self, texts: dict[tuple[str, str | None], str]) -> None:
        self.texts = dict(texts)
        self._rendered: dict[str, Rendered] = {}

    def template(self, name: str, dialect: str) -> str:
        """``name``'s text for ``dialect`` as written (``:name`` parameters)."""
        text = self.texts.get((name, dialect)) or self.texts.get((name, None))
        if text is None:
            raise KeyError(f"no statement {name!r} for {dialect} in queries.sql")
        return text

    def names(self, dialect: str) -> list[str]:
        return sorted({n for n, d in self.texts if d in (None, dialect)})

    def replaced(self, texts: dict[tuple[str, str | None], str]) -> Statements:
        """This set with ``texts`` (``{(name, dialect or None): text}``) in place of its own."""
        return Statements({**self.texts, **texts})

    def rendered(self, dialect: str) -> Rendered:
        found = self._rendered.get(dialect)
        if found is None:
            texts = {n: render(dialect, self.template(n, dialect)) for n in self.names(dialect)}
            found = self._rendered[dialect] = Rendered(texts)
        return found


class Rendered(dict[str, str]):
    """One dialect's statements by name, as sent; on PostgreSQL, :meth:`with_records` composes
    (once per shape) a fenced write with the parts that ride along in its statement."""

    def __init__(self, texts: dict[str, str]) -> None:
        super().__init__(texts)
        self._composed: dict[tuple[str, bool, bool, bool, bool], str] = {}

    def with_records(
        self,
        write: str,
        *,
        transition: bool,
        effects: bool,
        durable: bool = True,
        clear_steps: bool = False,
    ) -> str:
        """PostgreSQL: ``write`` (a fenced write's text) in ``WITH fenced AS (...)``, then its
        transition row (``with_transition``: ``%(action)s``, ``%(reason)s``), its outbox rows
        (``with_effects``: ``%(effects)s``) and its steps cleared (``with_cleared_steps``), as
        asked: one statement, one round trip, one commit. Its commit condition:
        ``durable_commit`` (waits for its WAL flush whatever the server's default) or
        ``async_commit`` (it does not), for the statement's own (AUTOCOMMIT) transaction."""
        shape = (write, transition, effects, durable, clear_steps)
        found = self._composed.get(shape)
        if found is None:
            parts = [f"WITH fenced AS ({write})"]
            if transition:
                parts.append(self["with_transition"])
            if effects:
                parts.append(self["with_effects"])
            if clear_steps:
                parts.append(self["with_cleared_steps"])
            parts.append("SELECT * FROM fenced")  # a registration's also its stored run
            parts.append("WHERE " + self["durable_commit" if durable else "async_commit"])
            found = self._composed[shape] = "\n".join(parts)
        return found


def _read_statements() -> Statements:
    text = (resources.files("celery_fence.store") / "queries.sql").read_text(encoding="utf-8")
    return Statements(parse_statements(text))


#: The fenced statements of :file:`queries.sql`, read once at import.
STATEMENTS = _read_statements()
#: The fence, as every fenced write of the task's path says it (:file:`queries.sql`).
OWNED = (
    "key = :key AND generation = :generation AND attempt_id = :attempt_id AND status = 'running'"
)
#: A registration's condition: a strictly greater generation of a live job.
NEWER_LIVE = (
    "fence_jobs.status NOT IN ('completed', 'dead')\n"
    "    AND fence_jobs.generation < excluded.generation"
)
