"""The pipeline's array parameters (:func:`celery_pulse.store.sql.pipeline.array_literal`):
every list the hot path sends is read back by PostgreSQL as the very same array.

Lists go as array literals in text, cast by the statement (``%s::text[]``), not through
psycopg's list dumper. Round trips through a real PostgreSQL, on the pipeline itself:
Hypothesis draws the values (quotes, backslashes, braces, commas, empty strings, NULL,
the largest bigints, infinities).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_pulse.store.sql.pipeline import Pipeline, array_literal

TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
               max_size=12)
CASES = {
    "text": st.lists(st.one_of(st.none(), TEXT), max_size=6),
    "bigint": st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), max_size=6),
    "float8": st.lists(st.one_of(st.none(), st.floats(allow_nan=False)), max_size=6),
    "bool": st.lists(st.one_of(st.none(), st.booleans()), max_size=6),
}


@pytest.fixture
def pipeline(pg_url: str) -> Iterator[Pipeline]:
    engine = sa.create_engine(pg_url)
    pipe = Pipeline(engine)
    try:
        yield pipe
    finally:
        pipe.close()
        engine.dispose()


def _same(sent: list[Any], got: list[Any]) -> bool:
    return len(sent) == len(got) and all(
        a == b or (isinstance(a, float) and math.isinf(a) and a == b)
        for a, b in zip(sent, got, strict=True))


@pytest.mark.parametrize("kind", sorted(CASES))
def test_pipeline_arrays_read_back_as_sent(pipeline: Pipeline, kind: str) -> None:
    """Each drawn list, sent as its literal through the pipeline, comes back equal."""

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(CASES[kind])
    def check(items: list[Any]) -> None:
        assert isinstance(array_literal(items), str)
        (rows,) = pipeline.run("test", [(f"SELECT %s::{kind}[]", (items,))])
        assert _same(items, rows[0][0]), (items, rows[0][0])

    check()


def test_pipeline_arrays_other_values_go_through_psycopg(pipeline: Pipeline) -> None:
    """A list holding anything else (here a Decimal) is sent as it is, by psycopg."""
    items = [Decimal("1.5"), None]
    assert array_literal(items) is items
    (rows,) = pipeline.run("test", [("SELECT %s::numeric[]", (items,))])
    assert rows[0][0] == items
