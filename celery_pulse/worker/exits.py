"""One function per way Celery can end a leased request, as the claim records it.

Every granted reservation reaches exactly one end. Celery ends requests in many places
(its strategy, its timer, the pool's callbacks, ``on_ack``/``on_reject``, a broker
reconnect, a shutdown); each reports here, and each way has one method of
:class:`RequestEnds`, named after the row of the table of exits in
docs/concepts/leases.md ("Where Celery can take a request away"):

* the strategy or the timer drops it (its id revoked, ``expires`` passed):
  :meth:`~RequestEnds.revoked_before_run` (revoked);
* the strategy raises (an invalid message, a bad ETA):
  :meth:`~RequestEnds.refused_by_strategy` (failed);
* ``reject`` before the pool, without requeue: :meth:`~RequestEnds.rejected_before_run`
  (failed);
* ``Reject(requeue=True)``, a dead process under ``reject_on_worker_lost``, a hard time
  limit under ``acks_late``: :meth:`~RequestEnds.requeued` (open, epoch + 1);
* revoked or expired while its start waited (a permit, a retry):
  :meth:`~RequestEnds.revoked_while_waiting` (revoked);
* the task returns: :meth:`~RequestEnds.succeeded`; ``self.retry()``:
  :meth:`~RequestEnds.retried` (retry); ``revoke(terminate=True)``:
  :meth:`~RequestEnds.terminated` (revoked); ``Ignore`` (``self.replace`` too):
  :meth:`~RequestEnds.ignored` (succeeded);
* it fails (an exception, ``Reject(requeue=False)``, a dead process, a hard time
  limit): :meth:`~RequestEnds.failed`;
* its lease was lost: :meth:`~RequestEnds.lease_lost`,
  :meth:`~RequestEnds.ran_stale` for a body that ended on its own after the loss (its
  outcome kept as evidence), and :meth:`~RequestEnds.lost_attempt_stopped` for a
  process that died stale (the store decides; watchers get ``pulse-attempt-ended``,
  never a ``task-failed``);
* pulse drops it before its body (lease lost, start refused):
  :meth:`~RequestEnds.not_run` (the store decides);
* Celery cancels it (``worker_cancel_long_running_tasks_on_connection_loss``, a cold or
  soft shutdown): :meth:`~RequestEnds.cancelled` (requeued, or the store decides);
* the broker connection is lost: :meth:`~RequestEnds.connection_lost` (released).

The pool's result callbacks report through :meth:`~RequestEnds.ran`, Celery's
``on_ack``/``on_reject`` through :meth:`~RequestEnds.verdict`; each picks one of these.

A warm or cold shutdown ends the rest in the keeper: its ``stop`` releases the
reservations never handed to the pool (:meth:`PulseWorker.shutdown
<celery_pulse.worker.service.PulseWorker.shutdown>`). Everything here runs on the
consumer's event loop (or inline under Celery's synchronous loop).
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import Terminated
from celery.exceptions import Ignore, Retry
from celery.worker import state as worker_state

from celery_pulse.errors import LeaseLost
from celery_pulse.leases import LOST, RUNNING, LocalClaim
from celery_pulse.store.base import FAILED, RETRY, REVOKED, SUCCEEDED
from celery_pulse.worker.events import ATTEMPT_ENDED, attempt_ended
from celery_pulse.worker.ports import WorkerForExits

# Logger names kept from before the move (operators' logging configurations name them):
# the worker's ends logged as the runtime, the pool's drops as the pool.
logger = logging.getLogger("celery_pulse.bootsteps.runtime")
intake_logger = logging.getLogger("celery_pulse.bootsteps.intake")
pool_logger = logging.getLogger("celery_pulse.pool.prefork")


def _killed_by_cancel(request: Any, exc: Any) -> bool:
    """Celery cancelled the request and its process died of it: Celery's ``on_failure``
    then leaves the message unsettled, for the broker. An attempt that ended by itself
    first (returned, raised) ends as it ended, as Celery settles it."""
    return bool(getattr(request, "_already_cancelled", False)) and isinstance(
        exc, (Terminated, SystemExit, KeyboardInterrupt))


def job_over(claim: LocalClaim) -> bool:
    """Whether the pool has had the claim's job's result already, so the process that ran
    it may be running another job now (a hard stop must not kill that one by its pid).

    The pool keeps a job's ``ApplyResult`` until its result arrives: one that is ready,
    or already dropped, is over. A claim with none (never handed over) is not.
    """
    ref = getattr(claim.request, "_apply_result", None)
    if ref is None:
        return False
    applied = ref()
    return applied is None or bool(applied.ready())


class RequestEnds:
    """How Celery ended a request, turned into the end of its claim."""

    def __init__(self, worker: WorkerForExits) -> None:
        self.worker = worker

    # -- Celery's verdict: on_ack / on_reject ------------------------------------------
    def verdict(self, claim: LocalClaim, kind: str, requeue: bool) -> None:
        """Celery acknowledged (``ack``) or rejected (``reject``) a leased request.

        An ack before the job went to the pool means Celery dropped the request (its id
        is revoked, or it expired). A reject of a job in the pool is remembered for the
        pool's result (:meth:`ran`), which ends the claim; one before the pool ends it
        now. A lost claim is left to the store (Recover).
        """
        if claim.state == LOST:
            return
        if kind == "ack":
            if not claim.applied:
                self.revoked_before_run(claim)
            return
        if claim.applied:
            claim.verdict = "requeue" if requeue else "reject"
        elif requeue:
            self.requeued(claim)
        else:
            self.rejected_before_run(claim)

    # -- before the pool ------------------------------------------------------------------
    def revoked_before_run(self, claim: LocalClaim) -> None:
        """Strategy or timer: the id is revoked, or ``expires`` passed."""
        self._end_unstarted(claim, REVOKED, "revoked or expired before it ran")

    def refused_by_strategy(self, claim: LocalClaim, exc: BaseException) -> None:
        """Celery's strategy raised (an invalid message, a bad header): Celery will never
        run the request, so the claim ends instead of being renewed forever."""
        intake_logger.error("pulse: Celery refused task %s (%r): failed, not run",
                            claim.task_id, exc)
        self._end_unstarted(claim, FAILED, f"refused by Celery: {exc!r}"[:500])

    def rejected_before_run(self, claim: LocalClaim) -> None:
        """Celery rejected the request, without requeue, before it reached the pool."""
        self._end_unstarted(claim, FAILED, "rejected by Celery before it ran")

    def revoked_while_waiting(self, claim: LocalClaim) -> None:
        """Celery marked the request revoked or expired while its start waited for a
        permit or a retry: it never reached a process."""
        self._record(claim, REVOKED, "revoked or expired before it ran")

    def requeued(self, claim: LocalClaim) -> None:
        """Celery's requeue: the task goes back to the broker as a new attempt (epoch + 1).

        The store moves the claim to ``open`` under this worker's publish lease and the
        recover thread publishes the stored message, as Recover does; if this worker dies
        in between, Recover publishes it once the publish lease expires.
        """
        worker = self.worker
        self._free_slot(claim)
        worker.keeper.forget(claim)
        worker.ahead.left(claim)
        if not worker.remote:  # a gateway worker's lease expires there, and Recover acts
            worker.recoverer.requeue(claim.key)
        logger.info("pulse: task %s epoch %d requeued by Celery", claim.task_id, claim.epoch)
        worker.claim_ended(claim.task_id)
        worker.admit_waiting()

    # -- after the pool: its result callbacks ---------------------------------------------
    def ran(self, claim: LocalClaim, exc: Any, failed: bool) -> None:
        """The pool's result: end the claim by what the attempt did and what Celery
        decided (its verdict)."""
        if isinstance(exc, LeaseLost):
            self.lease_lost(claim)
        elif claim.state == LOST:
            self.ran_stale(claim, exc, failed)
        elif claim.verdict == "requeue":
            self.requeued(claim)
        elif failed and _killed_by_cancel(claim.request, exc):
            self.cancelled(claim)
        elif not failed:
            self.succeeded(claim)
        elif isinstance(exc, Retry):
            self.retried(claim)
        elif getattr(claim.request, "_already_revoked", False) or isinstance(exc, Terminated):
            self.terminated(claim)
        elif isinstance(exc, Ignore):
            self.ignored(claim)
        else:
            self.failed(claim, exc)

    def succeeded(self, claim: LocalClaim) -> None:
        self._finish(claim, SUCCEEDED, None)

    def retried(self, claim: LocalClaim) -> None:
        """``self.retry()`` published the next attempt: this one ends ``retry`` (open)."""
        self._finish(claim, RETRY, None)

    def terminated(self, claim: LocalClaim) -> None:
        """``revoke(terminate=True)`` killed the process running it."""
        self._finish(claim, REVOKED, "revoked and terminated")

    def ignored(self, claim: LocalClaim) -> None:
        """``Ignore`` (``self.replace`` raises it after publishing the replacement)."""
        self._finish(claim, SUCCEEDED, "ignored")

    def failed(self, claim: LocalClaim, exc: Any) -> None:
        """An exception, ``Reject(requeue=False)``, a dead process, a hard time limit."""
        self._finish(claim, FAILED, repr(exc)[:1000])

    def cancelled(self, claim: LocalClaim) -> None:
        """Celery killed the attempt and left its message unacknowledged for the broker to
        deliver again (a connection loss under
        ``worker_cancel_long_running_tasks_on_connection_loss``, a cold or soft shutdown).

        pulse acknowledged that message at reservation, so the claim gives the task back
        instead: a task Recover would re-dispatch is requeued now (epoch + 1, within its
        budget); one that must not run twice is left to expire, and Recover sends it to
        review (it stopped halfway: its outcome is unknown).
        """
        if claim.start_in_background:  # its policy is redispatch
            self.requeued(claim)
            return
        logger.warning("pulse: task %s epoch %d cancelled by Celery: left to Recover "
                       "(not safe to run again)", claim.task_id, claim.epoch)
        self.lease_lost(claim)

    # -- leases lost, and jobs pulse drops ------------------------------------------------
    def lease_lost(self, claim: LocalClaim) -> None:
        """The attempt is stale: the store decides (Recover); nothing to record as ours."""
        worker = self.worker
        self._free_slot(claim)
        worker.keeper.forget(claim)
        worker.ahead.left(claim)
        worker.claim_ended(claim.task_id)
        worker.admit_waiting()

    def ran_stale(self, claim: LocalClaim, exc: Any, failed: bool) -> None:
        """The body ended on its own after its lease was lost here (the main process was
        paused past its deadline, the store could not be reached): the attempt is stale
        and the store decides (Recover), but what it did is kept in ``pulse_evidence``
        (its result or its error, at its epoch) for whoever reviews the task."""
        if not failed:
            outcome, error = SUCCEEDED, None
        elif isinstance(exc, Retry):
            outcome, error = RETRY, None
        elif isinstance(exc, Terminated):
            outcome, error = REVOKED, "revoked and terminated"
        elif isinstance(exc, Ignore):
            outcome, error = SUCCEEDED, "ignored"
        else:
            outcome, error = FAILED, repr(exc)[:1000]
        if self.worker.remote:  # pulse.worker.v1 has no evidence-only finish: not sent
            logger.warning("pulse: task %s epoch %d ended %s after its lease was lost: not "
                           "sent (a remote worker's late outcome is not kept)",
                           claim.task_id, claim.epoch, outcome)
        else:
            logger.warning("pulse: task %s epoch %d ended %s after its lease was lost: kept "
                           "as evidence only", claim.task_id, claim.epoch, outcome)
            self.worker.keeper.submit_late(claim, outcome, error)
        self.lease_lost(claim)

    def lost_attempt_stopped(self, claim: LocalClaim) -> None:
        """A stale attempt's process died (hard-stopped, or killed after its lease was
        lost): it must not write ``WorkerLostError`` to the result backend, nor count a
        chord part; the attempt that holds the lease now writes the outcome."""
        self.lease_lost(claim)
        request = claim.request
        if request is not None:
            worker_state.task_ready(request)
            # Watchers still see the attempt end, as a pulse event: a task-failed would
            # overwrite the current attempt's state in Flower.
            request.send_event(ATTEMPT_ENDED, **attempt_ended(claim, "failed", repr(LeaseLost(
                f"lease lost for task {claim.task_id} epoch {claim.epoch}: "
                f"hard-stopped ({claim.lost_reason})"))))

    def not_run(self, claim: LocalClaim, request: Any, why: str) -> None:
        """pulse drops a job before its body runs (its lease was lost, the store refused
        or could not take its start): the store decides, and Celery forgets it."""
        pool_logger.warning("pulse: task %s epoch %d dropped, not run: %s", claim.task_id,
                            claim.epoch, why)
        self.lease_lost(claim)
        if request is not None:
            worker_state.task_ready(request)

    def connection_lost(self, why: str) -> None:
        """The broker connection dropped: Celery cleared the requests not yet running.

        Their messages were acknowledged at reservation, so they are released instead
        (Recover re-dispatches each at once, under a new epoch).
        """
        self.worker.forget_deliveries()
        released = self.worker.keeper.release_unstarted(why)
        if released:
            logger.warning("pulse: %d reservation(s) released for immediate re-dispatch: %s",
                           released, why)

    # -- recording -------------------------------------------------------------------------
    def _end_unstarted(self, claim: LocalClaim, outcome: str, why: str) -> None:
        """End a claim whose request Celery will never run, so it is never renewed again."""
        logger.info("pulse: task %s epoch %d ends %s: %s", claim.task_id, claim.epoch,
                    outcome, why)
        self._record(claim, outcome, why)

    def _finish(self, claim: LocalClaim, outcome: str, error: str | None) -> None:
        self._free_slot(claim)
        self._record(claim, outcome, error)

    def _record(self, claim: LocalClaim, outcome: str, error: str | None) -> None:
        """Record the claim's outcome; deliveries waiting for its end look again after."""
        worker = self.worker
        task_id = claim.task_id
        part = claim.chord_part
        # A rate's start stays counted for its window: only concurrency permits come back.
        permits = tuple(p for p in claim.permits or () if p.window is None) if (
            claim.state == RUNNING) else None

        def done(_answer: Any, counted: tuple[int, str] | None) -> None:
            worker.loop.call(worker.claim_ended, task_id)
            if permits:  # given back with the completion: its waiters ask now
                worker.loop.call(worker.waits.freed, {p.key for p in permits})
                worker.signals.announce(permits)
            if counted is not None and part is not None and worker.chords is not None:
                worker.chords.counted(part, *counted)

        worker.keeper.submit_complete(claim, outcome, error, done)
        worker.ahead.left(claim)
        worker.admit_waiting()

    def _free_slot(self, claim: LocalClaim) -> None:
        if claim.slot is not None:
            self.worker.table.free(claim.slot)
            claim.slot = None
