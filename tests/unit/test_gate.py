"""The consume gate and the deliveries held over the prefetch limit."""

from __future__ import annotations

from typing import Any

from celery_pulse.bootsteps.gate import ConsumeGate
from celery_pulse.bootsteps.intake import Intake


class _TaskConsumer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cancel(self) -> None:
        self.calls.append("cancel")

    def consume(self) -> None:
        self.calls.append("consume")


class _Consumer:
    hub = None

    def __init__(self) -> None:
        self.task_consumer = _TaskConsumer()


class _Message:
    def __init__(self) -> None:
        self.rejected: list[bool] = []

    def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)


class _Pulse:
    keeper = None
    loop = None


def test_held_deliveries_go_back_to_the_broker_when_consumption_pauses() -> None:
    consumer = _Consumer()
    intake = Intake(_Pulse(), consumer)
    held = [_Message(), _Message()]
    intake.waiting.extend((None, m, None, None, None, None) for m in held)
    events: list[str] = []
    gate = ConsumeGate(consumer, on_pause=lambda: events.append(f"pause:{intake.requeue_waiting()}"),
                       on_resume=lambda: events.append("resume"))

    gate.close("registry: fenced")
    assert consumer.task_consumer.calls == ["cancel"]
    assert [m.rejected for m in held] == [[True], [True]]  # requeued, never acked
    assert not intake.waiting
    gate.close("drain")  # already paused: nothing more to give back
    gate.open("registry: fenced")
    assert not gate.is_open and consumer.task_consumer.calls == ["cancel"]
    gate.open("drain")
    assert consumer.task_consumer.calls == ["cancel", "consume"]
    assert events == ["pause:2", "resume"]


def test_a_requeue_failure_loses_nothing_else() -> None:
    class Broken(_Message):
        def reject(self, requeue: bool = False) -> None:
            raise ConnectionError("channel closed")

    intake = Intake(_Pulse(), _Consumer())
    good = _Message()
    intake.waiting.extend([(None, Broken(), None, None, None, None),
                           (None, good, None, None, None, None)])
    assert intake.requeue_waiting() == 1
    assert good.rejected == [True] and not intake.waiting


def test_a_contended_reservation_is_tried_again_without_pausing_consumption() -> None:
    """Contention is the store answering (other workers held the rows through all of its
    retries), not an outage: the gate stays open and this one delivery goes again."""
    from types import SimpleNamespace

    from celery_pulse.bootsteps.intake import CONTENDED_RETRY
    from celery_pulse.errors import Contended, StoreUnavailable
    from celery_pulse.leases import Counters
    from celery_pulse.store.base import Message, ReserveRequest

    consumer = _Consumer()
    gate = ConsumeGate(consumer)
    later: list[tuple[float, object]] = []
    settled: list[object] = []
    pulse = SimpleNamespace(
        keeper=SimpleNamespace(counters=Counters()), gate=gate,
        loop=SimpleNamespace(later=lambda delay, fn, *args: later.append((delay, fn)),
                             call=lambda fn, *args: fn(*args), hub=object()),
        ahead=SimpleNamespace(settled=lambda claim, *_: settled.append(claim)),
        admit_waiting=lambda: None)
    intake = Intake(pulse, consumer)
    message = Message(b"[]", {"id": "t-1"}, {}, {}, "application/json", "utf-8")
    request = ReserveRequest("t-1", "proj.add", message, "redispatch", 10)

    def handler(*args: object) -> None:
        raise AssertionError("retried at once, not after the backoff")

    intake.pending = 1
    intake._settle(Contended("deadlock"), 0.0, request, _Message(), b"[]", None, handler,
                   handler)
    assert gate.is_open and consumer.task_consumer.calls == []
    ((delay, again),) = later
    assert (delay, again.func, again.keywords) == (CONTENDED_RETRY, handler, {"admitted": True})
    assert settled == [None]
    assert pulse.keeper.counters.contended == 1 and intake.pending == 0

    # An outage, by contrast, pauses consumption until the store answers.
    intake.pending = 1
    intake._settle(StoreUnavailable("down"), 0.0, request, _Message(), b"[]", None, handler,
                   handler)
    assert not gate.is_open and consumer.task_consumer.calls == ["cancel"]


class _Delivery(_Message):
    """A task message as kombu hands it to the strategy."""

    def __init__(self, task_id: str) -> None:
        super().__init__()
        self.headers = {"id": task_id}
        self.properties: dict[str, object] = {}
        self.delivery_info = {"routing_key": "q"}
        self.body = b"[]"
        self.content_type = "application/json"
        self.content_encoding = "utf-8"


def test_a_store_outage_at_the_prefetch_limit_keeps_asking_the_store_and_holds_nothing(
        ) -> None:
    """Seen in the fault suite (RabbitMQ on MariaDB): a reservation failed with the store
    down, consumption paused, and its retry found the worker at the prefetch limit (two
    reservations had been granted meanwhile). Held back like a new delivery, the retry
    waited for a resume that only a successful reservation brings: deliveries unacked
    for good. A retry counts as admitted; a delivery that arrives while paused goes back."""
    from types import SimpleNamespace

    from celery_pulse.errors import StoreUnavailable
    from celery_pulse.leases import Counters

    consumer = _Consumer()
    submitted: list[tuple[str, Any]] = []
    timers: list[tuple[Any, tuple[Any, ...]]] = []
    keeper = SimpleNamespace(
        counters=Counters(), unstarted=lambda: 0, get=lambda task_id: None,
        store=SimpleNamespace(max_message_bytes=lambda: None),
        submit_reserve=lambda request, on_result, urgent: submitted.append(
            (request.task_id, on_result)))
    pulse = SimpleNamespace(
        keeper=keeper, prefetch_limit=2, waiting_for_permits=lambda: 0,
        settings=SimpleNamespace(on_lost=None, max_attempts=3),
        loop=SimpleNamespace(later=lambda delay, fn, *args: timers.append((fn, args)),
                             call=lambda fn, *args: fn(*args), hub=object()),
        ahead=SimpleNamespace(folding=0, fold=lambda free: False, lingers=lambda: False,
                              settled=lambda claim, *_: None),
        rules=SimpleNamespace(declared=False, limited=lambda task, routing_key: False),
        admit_waiting=lambda: None)
    intake = Intake(pulse, consumer)
    pulse.gate = ConsumeGate(consumer, on_pause=intake.requeue_waiting)
    intake._hold = True  # AMQP: over the limit, a delivery may wait unacknowledged
    handler = intake.wrap(SimpleNamespace(name="proj.add"), lambda *args: None)

    first = _Delivery("a")
    handler(first, None, None, None, None)
    assert [task_id for task_id, _ in submitted] == ["a"]
    keeper.unstarted = lambda: 2  # two other reservations granted meanwhile: at the limit
    submitted[0][1](StoreUnavailable("store unavailable during reserve"), 0.0)
    assert not pulse.gate.is_open and consumer.task_consumer.calls == ["cancel"]

    late = _Delivery("b")  # prefetched before the broker saw the cancel
    handler(late, None, None, None, None)
    assert late.rejected == [True] and not intake.waiting  # given back, never acked

    (retry, args), = timers
    retry(*args)
    assert [task_id for task_id, _ in submitted] == ["a", "a"]  # the store is asked again
    assert not intake.waiting and first.rejected == []
