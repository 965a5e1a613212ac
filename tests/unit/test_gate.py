"""The consume gate and the deliveries held over the prefetch limit."""

from __future__ import annotations

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
        ahead=SimpleNamespace(settled=lambda claim, folded, may_wait: settled.append(claim)),
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
    assert later == [(CONTENDED_RETRY, handler)] and settled == [None]
    assert pulse.keeper.counters.contended == 1 and intake.pending == 0

    # An outage, by contrast, pauses consumption until the store answers.
    intake.pending = 1
    intake._settle(StoreUnavailable("down"), 0.0, request, _Message(), b"[]", None, handler,
                   handler)
    assert not gate.is_open and consumer.task_consumer.calls == ["cancel"]
