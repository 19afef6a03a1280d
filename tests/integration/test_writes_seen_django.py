"""An SQLAlchemy write inside an open ``fence.atomic()`` block (Django's fenced block) is refused
like one beside ``fence.transaction()`` (issue 31, item 4: the SQLAlchemy guard was armed only by
``transaction()``/``session()``, and such a write landed unchecked)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from celery_fence.body import sqla, watch
from celery_fence.errors import ConfigurationError
from celery_fence.store import Store
from tests.integration.test_django_atomic import _attempt, alias, django_setup  # noqa: F401

metadata = sa.MetaData()
notes = sa.Table("t_seen_dj_notes", metadata, sa.Column("id", sa.Integer, primary_key=True))


@pytest.fixture
def app_engine(store: Store, db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db_url)
    metadata.drop_all(engine)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def test_an_sqlalchemy_write_inside_fence_atomic_is_refused(
    store: Store,
    alias: str,  # noqa: F811
    app_engine: sa.Engine,
) -> None:
    fence = _attempt(store)
    sqla.install()
    with watch.running(fence), fence.atomic(using=alias):
        with (
            pytest.raises(ConfigurationError, match="not the fenced block's"),
            app_engine.begin() as other,
        ):
            other.execute(notes.insert().values(id=1))
        with app_engine.connect() as other:  # a read passes
            assert other.execute(sa.select(notes)).all() == []
            other.commit()
    with app_engine.connect() as other:
        assert other.execute(sa.select(notes)).all() == []
