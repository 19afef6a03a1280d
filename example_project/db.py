"""The application's own tables: orders (the data) and export requests (stored before the job)."""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

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
    export_id = export_id or uuid.uuid4().hex[:12]
    with engine().begin() as conn:
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
    found = get_export(export_id)
    assert found is not None
    return found


def get_export(export_id: str) -> ExportRequest | None:
    with engine().connect() as conn:
        row = conn.execute(sa.select(exports).where(exports.c.id == export_id)).first()
    return None if row is None else ExportRequest(row.id, row.email, row.input_version)
