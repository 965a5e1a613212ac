"""The pulse pool: Celery's prefork pool (billiard) with a lease around each task.

Built on prefork so ``-c N``, time limits, ``max_tasks_per_child`` and revoke keep
working. The module path contains "prefork" on purpose: Celery's Django fixup
looks for it to decide how to handle database connections in children.

``apply_async`` runs on the consumer loop: it finds the claim the request was created
for (bound to the request by the intake, never looked up by task id) and wraps the
callbacks. The job goes to the pool with the lease in the request dict (the child
reads it) once the claim is ``running``: mostly it already is (the start was folded
into the reservation, or made ahead of the pool, see
:mod:`~celery_pulse.worker.ahead`); else the start goes out in the next group
commit. Children touch the store only through ``lease.fenced``.

The result callbacks run Celery's own first (it may reject or requeue the request,
see :class:`~celery_pulse.worker.verdict.CeleryVerdict`), then report the attempt's
end to the worker's exits (:mod:`celery_pulse.worker.exits`), which end the claim:
succeeded, failed, retry, revoked (a revoke that terminated it) or requeued. A lost
claim's attempt is stale: it ends nothing and writes nothing to the result backend.
What the pool needs of the worker is :class:`~celery_pulse.worker.ports.WorkerForPool`.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any

from celery.concurrency import prefork

from celery_pulse.errors import PulseError
from celery_pulse.leases import LOST, RUNNING, WAITING, LocalClaim
from celery_pulse.pool import child
from celery_pulse.store.base import LeaseKey, ResultRecord
from celery_pulse.worker.events import AttemptEvents
from celery_pulse.worker.ports import WorkerForPool
from celery_pulse.worker.verdict import bound_claim

logger = logging.getLogger(__name__)


def _exception(retval: Any) -> BaseException | None:
    exc = getattr(retval, "exception", None)
    return getattr(exc, "exc", exc) if type(exc).__name__ == "ExceptionWithTraceback" else exc


def _dropped_unwritten(job: Any) -> bool:
    """billiard forgot ``job`` before writing a byte of it to any process: it never ran.

    Celery's ``flush`` (at shutdown and on a broker reconnect) clears jobs not written
    yet and discards every job not accepted from the pool's cache; a job written (even in
    part) is finished writing, so a process may run it.
    """
    cache = getattr(job, "_cache", None)
    return (getattr(job, "_accepted", True) is False
            and getattr(job, "_write_to", False) is None
            and isinstance(cache, dict) and getattr(job, "_job", None) not in cache)


#: Seconds before a start the store failed is asked again, doubling up to MAX_START_RETRY
#: while it keeps failing (its lease, renewed meanwhile, bounds how long).
START_RETRY = 0.2
MAX_START_RETRY = 3.0


class TaskPool(prefork.TaskPool):
    """Prefork pool that runs each leased task under its lease."""

    #: Set by the registry step once the worker's pulse services exist.
    pulse: WorkerForPool | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # billiard's per-process restart event: a child a lost lease interrupted asks
        # with it to be replaced before its next job (:mod:`celery_pulse.pool.interrupt`).
        # It does not enable the ``pool_restart`` command (``worker_pool_restarts``).
        self.options["allow_restart"] = True
        #: Retried starts queued in Celery's semaphore for a pool process.
        self._awaiting_process: dict[LeaseKey,
                                     tuple[LocalClaim, tuple[Any, Any, Any, dict[str, Any]]]] = {}

    @property
    def service(self) -> WorkerForPool:
        """The worker service (bound by the registry step before any leased job)."""
        pulse = self.pulse
        if pulse is None:
            raise RuntimeError("pulse: a leased job reached the pool before its worker")
        return pulse

    def apply_async(self, target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        pulse = self.pulse
        callback = options.get("callback")
        request = getattr(callback, "__self__", None)
        claim = bound_claim(request) if pulse is not None else None
        if pulse is None or claim is None or not args or not isinstance(args[2], dict):
            return super().apply_async(target, args, kwargs, **options)
        claim.applied = True
        if claim.state == LOST or not pulse.keeper.is_live(claim):
            pulse.exits.not_run(claim, request, "lease lost before the task started")
            self._release_permit()
            return None
        claim.request = request
        if not isinstance(getattr(request, "send_event", None), AttemptEvents):
            # Its task events carry the attempt; a stale attempt's end is not Flower's.
            request.send_event = AttemptEvents(request, claim, pulse.keeper.is_live)  # type: ignore[union-attr]
        if claim.permits is None:
            claim.permits = pulse.permits(request)
        options["accept_callback"] = self._on_accepted(claim, options.get("accept_callback"))
        options["callback"] = self._on_result(claim, callback)
        options["error_callback"] = self._on_error(claim, options.get("error_callback"))
        job = (target, args, kwargs, options)
        if pulse.loop.hub is None:
            if claim.permits:  # the parent takes its permits (it may have to wait)
                return self._started(claim, job, pulse.keeper.start_now(claim))
            # Celery's synchronous loop (no hub) hands jobs over whether or not a process
            # is free, so here the child itself authorises the start before the body.
            return self._started(claim, job, True, start_in_child=True)
        if claim.state == RUNNING and not claim.in_pool:
            # Started already: folded into its reservation, or ahead of the pool
            # (:mod:`celery_pulse.worker.ahead`).
            return self._started(claim, job, True)
        if claim.starting:
            claim.waiting_job = job  # its start ahead answers (``hand_over``)
            return None
        if (claim.start_in_background and not claim.permits
                and pulse.keeper.start_in_background(claim)):
            return self._started(claim, job, True)
        # Celery calls us only with a pool process free for the job (its semaphore), so
        # this is the moment to authorise the start: in the next group commit, and the
        # child gets the job once the claim is ``running`` (no SQL in the child).
        self._submit_start(claim, job)
        return None

    def _submit_start(self, claim: LocalClaim, job: tuple[Any, Any, Any, dict[str, Any]]) -> None:
        """Queue the start; its outcome comes back to ``_started`` on the loop."""
        self.service.keeper.submit_start(claim, lambda result: self.service.loop.call(
            self._started, claim, job, result))

    def _started(self, claim: LocalClaim, job: tuple[Any, Any, Any, dict[str, Any]],
                 result: bool | str | PulseError, start_in_child: bool = False) -> Any:
        """On the loop: hand the job to a pool process, or drop it if the start failed."""
        service = self.service
        target, args, kwargs, options = job
        if isinstance(result, PulseError) and service.keeper.is_live(claim):
            claim.start_failures += 1
            delay = min(START_RETRY * 2 ** (claim.start_failures - 1), MAX_START_RETRY)
            logger.warning("pulse: starting task %s failed, retrying in %gs: %s", claim.task_id,
                           delay, result)
            self._release_permit()  # a pool process is not kept waiting for the store
            service.loop.later_kept(delay, self._retry_start, claim, job)
            return None
        claim.start_failures = 0
        if result == WAITING:
            # No free concurrency permit: the process goes back to other work, the task
            # waits (reserved, renewed) until one frees.
            self._release_permit()
            service.waits.settled(claim, job, "waiting")
            service.admit_waiting()
            return None
        if result is True and (claim.state == LOST or not service.keeper.is_live(claim)):
            result = False  # lost between the start's commit and now: never hand it over
        if claim.permits:
            service.waits.settled(claim, job, "started" if result is True else "gone")
        if result is not True:
            why = ("the store refused the start, or the lease was lost" if result is False
                   else f"the store could not be reached to start it: {result}")
            service.exits.not_run(claim, claim.request, why)
            self._release_permit()
            return None
        task_id = claim.task_id
        claim.slot = service.table.assign(task_id, claim.deadline)
        args[2]["pulse"] = {"task_id": task_id, "epoch": claim.epoch, "token": claim.token,
                            "slot": claim.slot, "deadline": claim.deadline,
                            "start_in_child": start_in_child}
        try:
            applied = super().apply_async(child.run_leased, (target, *args), kwargs, **options)
        except Exception:
            self._free_slot(claim)
            raise
        if applied is not None:
            claim.dropped_by_pool = functools.partial(_dropped_unwritten, applied)
            self._write_now()
        service.keeper.handed(claim)
        claim.handed_at = time.monotonic()
        service.ahead.left(claim)
        if claim.request is not None and applied is not None:
            claim.request._apply_result = weakref.ref(applied)  # what Request.terminate uses
        service.admit_waiting()
        return applied

    def _write_now(self) -> None:
        """Write the job just queued to an idle pool process now, not on the loop's next turn.

        billiard's asynpool queues a job and writes it once the next poll says a process's
        pipe is writable. A job handed over as a result comes back (Celery's semaphore
        releases its permit before the result callbacks run) would wait for pulse's
        completion bookkeeping and the loop committer's turn first: measured, 0.6-0.7 ms
        more per task between bodies than under plain prefork, 0.92x on 10 ms tasks. This
        calls the pool's own writer (the hub's ``consolidate_callback``, which the poll
        would call) with the idle processes' pipes: a pipe that can't take the job at once
        is left to the loop, as always. On a pool without these parts nothing changes.
        """
        pool = self._pool
        hub = self.service.loop.hub
        schedule = getattr(hub, "consolidate_callback", None)
        if schedule is None or not getattr(pool, "outbound_buffer", None):
            return
        try:
            idle = pool._all_inqueues - pool._active_writes - pool._busy_workers
            if idle:
                schedule(list(idle))
        except Exception as exc:  # what the poll's own call would have met: not ours to fix
            logger.warning("pulse: writing a job at once failed: %r", exc)

    def hand_over(self, claim: LocalClaim, job: tuple[Any, Any, Any, dict[str, Any]],
                  result: bool | PulseError) -> Any:
        """A start ahead of the pool answered while its job was waiting for it."""
        return self._started(claim, job, result)

    def _retry_start(self, claim: LocalClaim, job: tuple[Any, Any, Any, dict[str, Any]]) -> None:
        """Ask for the start again (after a store error, or when a permit may be free):
        with a pool process, which Celery's semaphore gives when one is free."""
        service = self.service
        if claim.state == LOST or not service.keeper.is_live(claim):
            self._abandon(claim, job, "lease lost before the task started")
            return
        request = claim.request
        if request is not None and request.revoked():  # Celery marked it revoked/expired
            if claim.permits:
                service.waits.settled(claim, job, "gone")
            service.exits.revoked_while_waiting(claim)
            return
        if service.stopping:
            return  # never started: released at shutdown
        if service.loop.hub is None:
            self._started(claim, job, service.keeper.start_now(claim))
            return
        semaphore = self.options.get("semaphore")
        if semaphore is None:
            self._submit_start(claim, job)
        else:
            self._awaiting_process[claim.key] = (claim, job)
            semaphore.acquire(self._got_process, claim, job)

    #: A task that waited for a concurrency permit asks for its start again.
    resume_waiting = _retry_start

    def _got_process(self, claim: LocalClaim, job: tuple[Any, Any, Any, dict[str, Any]]) -> None:
        self._awaiting_process.pop(claim.key, None)
        self._submit_start(claim, job)

    def awaiting_process(self) -> int:
        """How many retried starts wait for a pool process (worker stats)."""
        return len(self._awaiting_process)

    def semaphore_cleared(self, why: str) -> None:
        """Celery cleared its semaphore (a broker reconnect), and the callbacks queued in
        it with it: the retried starts waiting there for a process will never get one.
        Dropped here (their claims were released with the other unstarted ones), or a
        task waiting for a permit would hold its keys' turn for good: every later waiter
        of those keys stuck behind it, on a live worker (a fault-suite run caught it)."""
        awaiting = list(self._awaiting_process.values())
        self._awaiting_process.clear()
        for claim, job in awaiting:
            self._abandon(claim, job, why)

    def _abandon(self, claim: LocalClaim, job: tuple[Any, Any, Any, dict[str, Any]],
                 why: str) -> None:
        """Drop a job that holds no pool process (it waits for a retry or a permit)."""
        if claim.permits:
            self.service.waits.settled(claim, job, "gone")
        self.service.exits.not_run(claim, claim.request, why)

    # -- callbacks (run on the consumer loop) ---------------------------------------------
    def _on_accepted(self, claim: LocalClaim, original: Any) -> Any:
        def accepted(pid: int, time_accepted: float) -> Any:
            claim.pid = pid
            if claim.state == LOST:  # lost while waiting for a child: cancel right away
                self.service.on_lost(claim)
            elif self.service.keeper.mark_running(claim):  # the child starts it (no hub)
                self.service.admit_waiting()
            return original(pid, time_accepted) if original else None
        return accepted

    def _on_result(self, claim: LocalClaim, original: Any) -> Any:
        def on_result(result: Any) -> Any:
            if isinstance(result, tuple) and len(result) == 2 and result[0] == child.REFUSED:
                self.service.exits.not_run(claim, claim.request,
                                           "the lease was lost before the body started")
                return None
            if isinstance(result, tuple) and len(result) == 5 and result[0] == child.RECORDED:
                # Written (and a chord part counted, published) with the completion.
                claim.result = None if result[2] is None else ResultRecord(*result[2])
                claim.published = tuple(result[4] or ())
                claim.chord_part, result = result[3], result[1]
            if isinstance(result, tuple) and len(result) > 1 and not result[0] \
                    and isinstance(result[1], str):
                claim.returned = result[1]  # the tracer's repr of the return value
            try:
                return original(result) if original else None
            finally:
                failed, retval = result[0], result[1]
                self._end(claim, _exception(retval) if failed else None, failed)
        return on_result

    def _on_error(self, claim: LocalClaim, original: Any) -> Any:
        def on_error(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            if claim.hard_stopped or claim.state == LOST:
                # A stale attempt: it writes nothing (its lease's holder now does).
                self.service.exits.lost_attempt_stopped(claim)
                return None
            try:
                return original(exc_info, *args, **kwargs) if original else None
            finally:
                self._end(claim, _exception(exc_info) or exc_info, True)
        return on_error

    def _end(self, claim: LocalClaim, exc: Any, failed: bool) -> None:
        """The attempt ended: its run time counts, and the worker's exits end the claim."""
        service = self.service
        if claim.handed_at:
            service.ahead.ran(time.monotonic() - claim.handed_at)
        service.exits.ran(claim, exc, failed)

    def _free_slot(self, claim: LocalClaim) -> None:
        if claim.slot is not None:
            self.service.table.free(claim.slot)
            claim.slot = None

    def _release_permit(self) -> None:
        """Give back the pool permit of a job that was never submitted.

        With the event loop, Celery acquires a permit of the worker's semaphore (one per
        process) before calling ``apply_async``, and the pool releases it when the job's
        result comes back. A job we drop here never reaches the pool: without this the
        worker would run one process short for good (with ``-c 1``: nothing runs again).
        """
        semaphore = self.options.get("semaphore")
        if semaphore is not None:
            semaphore.release()

    # -- shutdown ----------------------------------------------------------------------------
    def on_stop(self) -> None:
        super().on_stop()  # waits for in-flight tasks (warm shutdown); leases keep renewing
        self._shutdown_pulse()

    def on_terminate(self) -> None:
        super().on_terminate()
        self._shutdown_pulse()

    def _shutdown_pulse(self) -> None:
        if self.pulse is not None:
            self.pulse.shutdown()
