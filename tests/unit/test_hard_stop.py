"""A hard stop kills the process still running a lost attempt, never the next job of a
process that was done with it.

The watchdog hard-stops a lost claim by its process id once the grace has passed. A
claim whose body ended (LeaseLost raised in time) but whose end is not recorded yet (the
store down: it stays in the table, its pid set) would otherwise have that process killed
while it runs another task, which then ends ``failed`` with ``WorkerLostError`` under a
lease it holds (read as the cause of a fault-suite failover run's one failed task, and of
the docs' store-outage example's re-dispatched attempt never succeeding). Real processes
here, and billiard's own ``ApplyResult``, as the pool keeps it.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from billiard.pool import ApplyResult

from celery_pulse.leases import LOST, LocalClaim
from celery_pulse.worker.exits import job_over
from celery_pulse.worker.service import PulseWorker


@pytest.fixture
def process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _lost_claim(pid: int, applied: ApplyResult | None) -> LocalClaim:
    claim = LocalClaim("t-hard", 1, "token", deadline=0.0)
    claim.state, claim.pid = LOST, pid
    claim.request = SimpleNamespace(
        _apply_result=None if applied is None else weakref.ref(applied))
    return claim


def _hard_stop(claim: LocalClaim) -> None:
    PulseWorker.on_hard_stop(cast(Any, SimpleNamespace(_signal=PulseWorker._signal)), claim)


def test_hard_stop_kills_the_process_still_running_the_lost_job(
        process: subprocess.Popen[bytes]) -> None:
    applied = ApplyResult({}, None)  # no result yet: the body still runs
    claim = _lost_claim(process.pid, applied)
    assert not job_over(claim)
    _hard_stop(claim)
    assert process.wait(10) == -9


def test_hard_stop_spares_a_process_whose_job_already_ended(
        process: subprocess.Popen[bytes]) -> None:
    applied = ApplyResult({}, None)
    applied._set(0, (False, RuntimeError("lease lost")))  # its result came back
    claim = _lost_claim(process.pid, applied)
    assert job_over(claim)
    _hard_stop(claim)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.5)  # still alive: another job may be running there


def test_hard_stop_spares_a_process_whose_job_the_pool_dropped(
        process: subprocess.Popen[bytes]) -> None:
    applied: ApplyResult | None = ApplyResult({}, None)
    claim = _lost_claim(process.pid, applied)
    applied = None  # the pool let go of it: its result was handled
    gc.collect()
    assert job_over(claim)
    _hard_stop(claim)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.5)
