"""The rules of a remote worker's publications (gateway/outbox.py) and of the deliveries a
feeder holds back (gateway/waiting.py), without processes: the real-process behaviour is
tests/acceptance/test_gateway_publishing.py."""

from __future__ import annotations

import base64
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_pulse.gateway.frames import Code, ProtocolError
from celery_pulse.gateway.outbox import published
from celery_pulse.gateway.protocol import AttemptRef, Finish
from celery_pulse.gateway.waiting import Waiting, eta_in, newer
from celery_pulse.store.base import Refusal, ReserveRequest

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)


def _finish(publish: Any) -> Finish:
    ref = AttemptRef("a" * 32, "b" * 32, 1, "s" * 32)
    return Finish(ref, "FAILED", {"celery_meta": {"status": "RETRY"}, "publish": publish},
                  "celery.retry")


def _message(queue: str = "q1", **changes: Any) -> dict[str, Any]:
    message = {"queue": queue, "body": base64.b64encode(b"[[], {}, {}]").decode(),
               "content_type": "application/json", "content_encoding": "utf-8",
               "headers": {"id": "t1", "task": "proj.add", "eta": None},
               "properties": {"priority": 0, "reply_to": "r", "body_encoding": "base64"}}
    message.update(changes)
    return message


def test_a_publication_to_the_instances_queue_is_published_with_its_properties() -> None:
    [message] = published(_finish([_message()]), "q1")
    assert message["body"] == b"[[], {}, {}]"
    assert message["headers"]["task"] == "proj.add"
    assert (message["priority"], message["reply_to"]) == (0, "r")
    assert "body_encoding" not in message and "queue" not in message  # never passed on


def test_a_publication_to_another_queue_is_forbidden() -> None:
    with pytest.raises(ProtocolError) as refused:
        published(_finish([_message(), _message("q2")]), "q1")
    assert refused.value.code == Code.FORBIDDEN
    assert "publish[1]" in refused.value.message


@pytest.mark.parametrize("publish", [
    "not a list", [_message() for _ in range(101)], ["not an object"],
    [_message(body="not base64!")], [_message(headers={"id": "t1"})],
    [_message(content_type=None)], [_message(properties=[])]])
def test_a_malformed_publication_is_an_invalid_frame(publish: Any) -> None:
    with pytest.raises(ProtocolError) as refused:
        published(_finish(publish), "q1")
    assert refused.value.code == Code.INVALID_FRAME


def test_a_finish_without_publications_publishes_nothing() -> None:
    ref = AttemptRef("a" * 32, "b" * 32, 1, "s" * 32)
    assert published(Finish(ref, "SUCCEEDED", {"celery_meta": {}}, None), "q1") == []
    assert published(Finish(ref, "SUCCEEDED", 42, None), "q1") == []


def test_eta_in_reads_celerys_eta_as_its_worker_does() -> None:
    soon = (NOW + timedelta(seconds=30)).isoformat()
    assert eta_in({"eta": soon}, timezone.utc, NOW) == 30
    assert eta_in({"eta": (NOW - timedelta(seconds=5)).isoformat()}, timezone.utc, NOW) == 0
    assert eta_in({"eta": None}, timezone.utc, NOW) == 0
    assert eta_in({}, timezone.utc, NOW) == 0
    assert eta_in({"eta": "not a time"}, timezone.utc, NOW) == 0
    naive = (NOW + timedelta(seconds=10)).replace(tzinfo=None).isoformat()
    assert eta_in({"eta": naive}, timezone.utc, NOW) == 10  # in the app's timezone


def _request(publication: str | None, retries: int = 0) -> ReserveRequest:
    return ReserveRequest("t1", "proj.add", None, "redispatch", 3, retries,  # type: ignore[arg-type]
                          publication)


def test_only_a_new_publication_refused_as_taken_waits_for_the_live_attempt() -> None:
    taken = Refusal("t1", "taken", "running", "gw:x", 1, 0, "pub-1")
    assert newer(_request("pub-2"), taken)
    assert not newer(_request("pub-1"), taken)  # a redelivery of the live one: duplicate
    assert not newer(_request("pub-2"), Refusal("t1", "terminal", "succeeded", None, 1, 0,
                                                "pub-1"))
    assert newer(_request(None, retries=1), Refusal("t1", "taken", "running", "gw:x", 1, 0))
    assert not newer(_request(None, retries=0), Refusal("t1", "taken", "running", "gw:x", 1, 0))


def test_waiting_deliveries_come_due_in_time_order() -> None:
    waiting = Waiting()
    waiting.hold(5.0, "late", _request("a"))
    waiting.hold(2.0, "early", _request("b"))
    assert len(waiting) == 2
    assert waiting.wait(1.0, 0.5) == 0.5
    assert waiting.wait(1.8, 0.5) == pytest.approx(0.2)
    assert waiting.due(1.9) == []
    assert [m for m, _ in waiting.due(5.0)] == ["early", "late"]
    assert len(waiting) == 0 and waiting.wait(6.0, 0.5) == 0.5
