"""Celery's ``on_ack``/``on_reject`` bound to a claim also take Celery's step of restoring
the prefetch count after a reconnect (``celery_pulse.worker.verdict``)."""

from __future__ import annotations

from typing import Any

from celery_pulse.leases import LocalClaim
from celery_pulse.worker.verdict import CeleryVerdict


class _Consumer:
    """Celery's consumer as the step sees it: lowered until ``steps_left`` steps ran."""

    def __init__(self, steps_left: int) -> None:
        self.steps_left = steps_left

    @property
    def _maximum_prefetch_restored(self) -> bool:
        return self.steps_left == 0

    def _restore_prefetch_count_after_connection_restart(self, _promise: Any) -> None:
        self.steps_left -= 1


class _Exits:
    def __init__(self) -> None:
        self.verdicts: list[tuple[str, bool]] = []

    def verdict(self, claim: LocalClaim, kind: str, requeue: bool) -> None:
        self.verdicts.append((kind, requeue))


def _verdict(consumer: _Consumer, kind: str = "ack") -> tuple[CeleryVerdict, _Exits]:
    exits = _Exits()
    claim = LocalClaim("t-1", 1, "token", deadline=1e12)
    return CeleryVerdict(exits, claim, kind, consumer), exits  # type: ignore[arg-type]


def test_a_request_received_while_the_count_is_lowered_takes_one_step_when_it_ends() -> None:
    consumer = _Consumer(steps_left=2)
    ack, exits = _verdict(consumer)
    reject, _ = _verdict(consumer, "reject")
    ack()
    reject(None, None, True)
    assert consumer.steps_left == 0
    assert exits.verdicts == [("ack", False)]


def test_no_step_once_restored_nor_for_a_request_received_before_the_reconnect() -> None:
    consumer = _Consumer(steps_left=0)
    before, _ = _verdict(consumer)  # received while the count was whole
    consumer.steps_left = 1  # then a reconnect lowered it
    before()
    assert consumer.steps_left == 1
    after, _ = _verdict(consumer)
    after()
    after()  # restored: no further step
    assert consumer.steps_left == 0
