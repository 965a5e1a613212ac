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
