"""The pulse pool: Celery's prefork pool (billiard) with a lease around each task.

Built on prefork so ``-c N``, time limits, ``max_tasks_per_child`` and revoke keep
working. The module path contains "prefork" on purpose: Celery's Django fixup
looks for it to decide how to handle database connections in children.

``apply_async`` runs on the consumer loop: it only looks up the task's local claim,
puts the lease into the request dict (the child reads it) and wraps the target and
callbacks; the store is touched by the child (start) and the committer (completion).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.concurrency import prefork
from celery.exceptions import Ignore, Retry
from celery.worker import state as worker_state

from celery_pulse.errors import LeaseLost
from celery_pulse.leases import LOST, RESERVED, LocalClaim
from celery_pulse.pool import child
from celery_pulse.store.base import FAILED, RETRY, SUCCEEDED

logger = logging.getLogger(__name__)


def _exception(retval: Any) -> BaseException | None:
    exc = getattr(retval, "exception", None)
    return getattr(exc, "exc", exc) if type(exc).__name__ == "ExceptionWithTraceback" else exc


class TaskPool(prefork.TaskPool):
    """Prefork pool that runs each leased task under its lease."""

    #: Set by the registry step once the worker's pulse services exist.
    pulse: Any = None

    def apply_async(self, target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        pulse = self.pulse
        task_id = options.get("correlation_id")
        claim: LocalClaim | None = pulse.keeper.get(task_id) if pulse and task_id else None
        if claim is None or not args or not isinstance(args[2], dict):
            return super().apply_async(target, args, kwargs, **options)
        callback = options.get("callback")
        request = getattr(callback, "__self__", None)
        if claim.state == LOST or not pulse.keeper.is_live(claim):
            self._drop(claim, request, "lease lost before the task started")
            self._release_permit()
            return None
        claim.request = request
        claim.slot = pulse.table.assign(task_id, claim.deadline)
        args[2]["pulse"] = {"task_id": task_id, "epoch": claim.epoch, "token": claim.token,
                            "slot": claim.slot, "deadline": claim.deadline}
        options["accept_callback"] = self._on_accepted(claim, options.get("accept_callback"))
        options["callback"] = self._on_result(claim, callback)
        options["error_callback"] = self._on_error(claim, options.get("error_callback"))
        return super().apply_async(child.run_leased, (target, *args), kwargs, **options)

    # -- callbacks (run on the consumer loop) ---------------------------------------------
    def _on_accepted(self, claim: LocalClaim, original: Any) -> Any:
        def accepted(pid: int, time_accepted: float) -> Any:
            claim.pid = pid
            if claim.state == RESERVED:
                self.pulse.keeper.mark_running(claim)
            elif claim.state == LOST:  # lost while waiting for a child: cancel right away
                self.pulse.on_lost(claim)
            self.pulse.admit_waiting()
            return original(pid, time_accepted) if original else None
        return accepted

    def _on_result(self, claim: LocalClaim, original: Any) -> Any:
        def on_result(result: Any) -> Any:
            if isinstance(result, tuple) and len(result) == 2 and result[0] == child.REFUSED:
                self._drop(claim, claim.request, "the store refused the start")
                return None
            failed, retval = result[0], result[1]
            if not failed:
                self._finish(claim, SUCCEEDED, None)
            else:
                exc = _exception(retval)
                if isinstance(exc, Retry):
                    self._finish(claim, RETRY, None)
                elif isinstance(exc, LeaseLost) or claim.state == LOST:
                    self._forget(claim)  # the store decides; nothing to record as ours
                elif isinstance(exc, Ignore):
                    self._finish(claim, SUCCEEDED, "ignored")
                else:
                    self._finish(claim, FAILED, repr(exc))
            return original(result) if original else None
        return on_result

    def _on_error(self, claim: LocalClaim, original: Any) -> Any:
        def on_error(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            value = original(exc_info, *args, **kwargs) if original else None
            if claim.hard_stopped or claim.state == LOST:
                self._forget(claim)
                lease_lost = LeaseLost(f"lease lost for task {claim.task_id} epoch "
                                       f"{claim.epoch}: hard-stopped after ignoring LeaseLost")
                try:
                    self.pulse.app.backend.mark_as_failure(claim.task_id, lease_lost)
                except Exception:
                    logger.debug("pulse: no result backend to record LeaseLost", exc_info=True)
            else:
                self._finish(claim, FAILED, repr(getattr(exc_info, "exception", exc_info)))
            return value
        return on_error

    def _finish(self, claim: LocalClaim, outcome: str, error: str | None) -> None:
        self._free_slot(claim)
        self.pulse.keeper.submit_complete(claim, outcome, error)
        self.pulse.admit_waiting()

    def _forget(self, claim: LocalClaim) -> None:
        self._free_slot(claim)
        self.pulse.keeper.forget(claim)
        self.pulse.admit_waiting()

    def _free_slot(self, claim: LocalClaim) -> None:
        if claim.slot is not None:
            self.pulse.table.free(claim.slot)
            claim.slot = None

    def _drop(self, claim: LocalClaim, request: Any, why: str) -> None:
        logger.warning("pulse: task %s epoch %d dropped, not run: %s", claim.task_id,
                       claim.epoch, why)
        self._forget(claim)
        if request is not None:
            worker_state.task_ready(request)

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
