"""The fault tests' history: one schema per test holding ``fault_events``, where the
bodies of ``tests.apps.faultapp`` record what they did (the checker reads it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.helpers import services
from tests.helpers.pg import Schema


@pytest.fixture
def history() -> Iterator[str]:
    services.require("postgres")
    schema = Schema(services.PG_ADMIN_URL, prefix=services.SCHEMA_PREFIX).create()
    engine = sa.create_engine(schema.url)
    with engine.begin() as conn:
        conn.execute(sa.text("create table fault_events (id bigserial primary key, kind text, "
                             "task_id text, epoch bigint, worker text, pid int, "
                             "at timestamptz, extra text, name text, attempt text)"))
        conn.execute(sa.text("create index on fault_events (attempt)"))
    engine.dispose()
    try:
        yield schema.url
    finally:
        schema.drop()
