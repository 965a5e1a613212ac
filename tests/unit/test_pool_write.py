"""The pool writes a job handed over to an idle process at once (``TaskPool._write_now``).

The write itself is billiard's (the hub's ``consolidate_callback``, which the loop's poll
would call); what is ours is which pipes it is offered and when it is not called at all.
The gain is measured by the throughput benchmark (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import collections
import types
from typing import Any

from celery_pulse.pool.prefork import TaskPool


def _pool(hub: Any, outbound: list[str], inqueues: set[int], active: set[int],
          busy: set[int]) -> TaskPool:
    pool = TaskPool.__new__(TaskPool)  # no processes: only the parts _write_now reads
    pool._pool = types.SimpleNamespace(outbound_buffer=collections.deque(outbound),
                                       _all_inqueues=inqueues, _active_writes=active,
                                       _busy_workers=busy)
    pool.pulse = types.SimpleNamespace(loop=types.SimpleNamespace(hub=hub))
    return pool


class Hub:
    def __init__(self) -> None:
        self.offered: list[list[int]] = []

    def consolidate_callback(self, fds: list[int]) -> None:
        self.offered.append(sorted(fds))


def test_a_queued_job_is_offered_to_the_idle_pipes_only() -> None:
    hub = Hub()
    _pool(hub, ["job"], inqueues={3, 5, 7, 9}, active={5}, busy={7})._write_now()
    assert hub.offered == [[3, 9]]


def test_nothing_is_written_when_no_job_waits_or_no_process_is_idle() -> None:
    hub = Hub()
    _pool(hub, [], inqueues={3, 5}, active=set(), busy=set())._write_now()
    _pool(hub, ["job"], inqueues={3, 5}, active={3}, busy={5})._write_now()
    assert hub.offered == []


def test_without_an_event_loop_or_its_writer_the_loop_writes_as_before() -> None:
    _pool(None, ["job"], inqueues={3}, active=set(), busy=set())._write_now()
    _pool(object(), ["job"], inqueues={3}, active=set(), busy=set())._write_now()


def test_a_failing_write_is_left_to_the_loop_and_logged(caplog: Any) -> None:
    class Broken:
        def consolidate_callback(self, fds: list[int]) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    _pool(Broken(), ["job"], inqueues={3}, active=set(), busy=set())._write_now()
    assert "writing a job at once failed" in caplog.text
