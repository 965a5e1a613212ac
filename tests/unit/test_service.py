"""The background-thread base (:mod:`celery_pulse.service`): name, wake-up, stop, join."""

from __future__ import annotations

import threading

from celery_pulse.service import Service


class Counting(Service):
    """Counts its rounds; each round sleeps up to an hour unless woken."""

    def __init__(self) -> None:
        super().__init__("pulse-test", join_timeout=5)
        self.rounds = 0
        self.names: list[tuple[str, bool]] = []
        self.round_done = threading.Event()

    def run(self) -> None:
        while not self.stopping:
            self.rounds += 1
            thread = threading.current_thread()
            self.names.append((thread.name, thread.daemon))
            self.round_done.set()
            self.sleep(3600)


def test_a_service_runs_on_its_named_daemon_thread_and_a_wake_cuts_its_sleep() -> None:
    service = Counting()
    service.start()
    assert service.round_done.wait(5)
    service.round_done.clear()
    service.wake()
    assert service.round_done.wait(5)
    service.stop()
    assert service.rounds == 2 and service.names == [("pulse-test", True)] * 2
    assert not any(t.name == "pulse-test" for t in threading.enumerate())  # joined


def test_a_wake_asked_while_working_is_not_lost() -> None:
    service = Service("pulse-test", join_timeout=1)
    service.wake()
    assert service.sleep(3600) is False  # returns at once: the wake-up came first
    service.signal_stop()
    assert service.sleep(3600) is True and service.sleep(3600) is True


def test_a_target_runs_instead_of_a_subclass_and_a_service_may_stop_itself() -> None:
    ran = threading.Event()
    service: Service

    def loop() -> None:
        ran.set()
        service.stop()  # from its own thread: no join of itself

    service = Service("pulse-test", join_timeout=5, target=loop)
    service.start()
    assert ran.wait(5)
    service.join()
    assert service.stopping
