"""The application's own tables: orders (the data), export requests (stored before the job) and
reports (written by ``build_report`` through ``self.fence.transaction()``)."""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from . import settings

metadata = sa.MetaData()

orders = sa.Table(
    "example_orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),  # only grows: the id is the data's version
    sa.Column("customer", sa.String(100), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
)

exports = sa.Table(
    "example_exports",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # stable: the same across every retry
    sa.Column("email", sa.String(255), nullable=False),
    sa.Column("input_version", sa.Integer, nullable=False),  # the snapshot the export reads
    sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
)


reports = sa.Table(
    "example_reports",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # one row per report: a re-run replaces it
    sa.Column("orders", sa.Integer, nullable=False),
    sa.Column("revenue_cents", sa.Integer, nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),  # which attempt wrote it
    sa.Column("attempt_id", sa.String(64), nullable=False),
)


@dataclass(frozen=True)
class ExportRequest:
    id: str
    email: str
    input_version: int


@functools.cache
def engine() -> sa.Engine:
    return sa.create_engine(settings.DATABASE_URL)


def create_tables() -> None:
    metadata.create_all(engine())


def add_orders(rows: list[dict[str, Any]]) -> None:
    with engine().begin() as conn:
        conn.execute(orders.insert(), rows)


def orders_up_to(version: int | None = None) -> list[dict[str, Any]]:
    query = sa.select(orders).order_by(orders.c.id)
    if version is not None:
        query = query.where(orders.c.id <= version)
    with engine().connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def request_export(email: str, export_id: str | None = None) -> ExportRequest:
    """Store the request first — a stable id and the input version it will read — then send it.

    Calling it again with the same ``export_id`` returns the stored request (no second export).
    """
    with engine().begin() as conn:
        export_id = store_export(conn, email, export_id)
    found = get_export(export_id)
    assert found is not None
    return found


def store_export(conn: sa.Connection, email: str, export_id: str | None = None) -> str:
    """Write an export request in ``conn``'s transaction (the caller enqueues its job in the same
    one: ``enqueue(conn, generate_export, args=(export_id,))``); returns its id."""
    export_id = export_id or uuid.uuid4().hex[:12]
    version = conn.execute(sa.select(sa.func.coalesce(sa.func.max(orders.c.id), 0))).scalar()
    conn.execute(
        sa.insert(exports)
        .prefix_with("OR IGNORE", dialect="sqlite")
        .values(
            id=export_id,
            email=email,
            input_version=version,
            requested_at=dt.datetime.now(dt.timezone.utc),
        )
    )
    return export_id


def get_export(export_id: str) -> ExportRequest | None:
    with engine().connect() as conn:
        row = conn.execute(sa.select(exports).where(exports.c.id == export_id)).first()
    return None if row is None else ExportRequest(row.id, row.email, row.input_version)


def save_report(conn: sa.Connection, report: dict[str, Any], *, attempt_id: str) -> None:
    """Upsert the report on ``conn`` (the task's fenced transaction): keyed by the report, so the
    attempt that commits last — only ever the one that owns the job — leaves its row."""
    insert = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(reports)
    values = {
        "id": report["report_id"],
        "orders": report["orders"],
        "revenue_cents": report["revenue_cents"],
        "generation": report["generation"],
        "attempt_id": attempt_id,
    }
    stmt = insert.values(**values)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[reports.c.id],
            set_={k: stmt.excluded[k] for k in values if k != "id"},
        )
    )


def get_report(report_id: str) -> dict[str, Any] | None:
    with engine().connect() as conn:
        row = conn.execute(sa.select(reports).where(reports.c.id == report_id)).first()
    return None if row is None else dict(row._mapping)
