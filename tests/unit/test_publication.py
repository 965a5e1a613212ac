"""Each publication of a task gets an identity of its own, except a beat slot's copies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

import celery_pulse
from celery_pulse.bootsteps.intake import PUBLICATION_HEADER, publication_of
from celery_pulse.bootsteps.schedules import publisher
from celery_pulse.store.base import Slot


@pytest.fixture
def published() -> Iterator[tuple[Celery, list[dict[str, Any]]]]:
    app = Celery("publication-test", broker="memory://", set_as_current=False)
    celery_pulse.install(app)
    seen: list[dict[str, Any]] = []

    def record(headers: Any = None, **_kwargs: Any) -> None:
        seen.append(dict(headers))  # runs after pulse's stamp (connected earlier)
    before_task_publish.connect(record, weak=False, dispatch_uid="publication-test")
    try:
        yield app, seen
    finally:
        before_task_publish.disconnect(dispatch_uid="publication-test")
        app.close()


def test_every_send_is_a_new_publication_even_of_one_task_id(
        published: tuple[Celery, list[dict[str, Any]]]) -> None:
    app, seen = published
    app.send_task("t.x", task_id="same")
    # As a retry copying its request's headers would: the old identity is not kept.
    app.send_task("t.x", task_id="same", headers={PUBLICATION_HEADER: seen[0][PUBLICATION_HEADER]})
    first, second = (publication_of(h) for h in seen)
    assert first and second and first != second


def test_a_beat_slot_published_twice_is_one_publication(
        published: tuple[Celery, list[dict[str, Any]]]) -> None:
    app, seen = published
    publish = publisher(app)
    slot = Slot("entry", 100.0, "slot-task-id", "t.x",
                '{"args": [], "kwargs": {}, "options": {"headers": {"mine": 1}}}')
    publish(slot)
    publish(slot)  # the next leader re-publishes a slot left unmarked
    publish(Slot("entry", 160.0, "slot-task-id-2", "t.x",
                 '{"args": [], "kwargs": {}, "options": {}}'))
    pubs = [publication_of(h) for h in seen]
    assert pubs[0] == pubs[1] and pubs[2] not in (None, pubs[0])
    assert all("pulse_pub_fixed" not in h for h in seen)  # moved, not kept for retries
    assert seen[0]["mine"] == 1
