"""A remote worker's finish in the gateway app's result backend: the dispatch glue to Celery.

The store settles the attempt (:class:`~celery_pulse.gateway.dispatch.Fenced`); this
module turns the finish into the Celery state and the backend call that records it, and
says whether the completion itself can carry it: with ``pulse://`` on the gateway's own
store the result is written in the completion's transaction, as a direct worker's is
(one round trip, and never a settled claim without its result). Celery is imported only
for its state names, and only when a finish is recorded.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from celery_pulse.deferral import DEFERRED_STATES, carried_by_completions, deferred_result
from celery_pulse.gateway.dispatch import Fenced
from celery_pulse.gateway.protocol import Finish, is_revoke
from celery_pulse.gateway.session import LEASED, Attempt
from celery_pulse.store.base import Store
from celery_pulse.store.records import Completion


class RemoteTaskError(Exception):
    """A task a gateway worker reported FAILED (its error code and result)."""


# A stored failure names its exception's module (Celery's ``exc_module``): results keep
# naming the path this class was first published at, which still exports it.
RemoteTaskError.__module__ = "celery_pulse.gateway.server"


class Results:
    """The app's result backend as the gateway records finishes in it."""

    def __init__(self, app: Any, store: Store | None) -> None:
        self.app, self.store = app, store
        #: Whether finishes carry their results (:meth:`carried`; None: not asked yet).
        self._carries: bool | None = None

    def completion(self, attempt: Attempt, finish: Finish) -> tuple[Completion, bool]:
        """The finish as the store's completion (blocking: a thread's, where the app's
        backend is asked), and whether it carries the result too (see the module's
        rules)."""
        # A finish without a start (seed 003 §4): the instance proved who it is, but the
        # attempt never had authority to run, so its outcome is evidence, never applied.
        stale = attempt.state == LEASED
        backend = self.backend()
        state, call = self.call(backend, attempt, finish)
        record = None
        if (not stale and call is not None and state in DEFERRED_STATES
                and self.carried(backend)):
            with deferred_result(attempt.task_id) as deferral:
                call()  # kept in deferral.record, not written
            record = deferral.record
        return Fenced.completion(attempt, finish.outcome, finish.error_code, record,
                                 returned=returned(finish), stale=stale), record is not None

    def carried(self, backend: Any) -> bool:
        """Whether this store's completions can carry ``backend``'s results: asked once
        (neither the store nor the app's backend URL changes), not on every finish."""
        if self._carries is None:
            url = getattr(self.store, "url", None)
            self._carries = url is not None and carried_by_completions(backend, url)
        return self._carries

    def backend(self) -> Any:
        """The app's result backend (Celery's is per thread: ask in the thread using it),
        or None where it has none (Celery's ``DisabledBackend``: nothing to write, so no
        thread is taken for it on every finish)."""
        backend = getattr(self.app, "backend", None) if self.app is not None else None
        if backend is None:
            return None
        from celery.backends.base import DisabledBackend

        return None if isinstance(backend, DisabledBackend) else backend

    @staticmethod
    def call(backend: Any, attempt: Attempt, finish: Finish
             ) -> tuple[str | None, Callable[[], Any] | None]:
        """The Celery state of a finish and the backend call that stores it (None for
        UNKNOWN, whose outcome a human decides, or with no backend)."""
        if backend is None or finish.outcome == "UNKNOWN":
            return None, None
        from celery import states

        if is_revoke(finish.outcome, finish.error_code):
            # Celery's revoke on the worker (terminated, or revoked before it ran): its
            # parent's REVOKED, whatever the pool's failure said after.
            from celery.exceptions import TaskRevokedError

            return states.REVOKED, functools.partial(
                backend.store_result, attempt.task_id, TaskRevokedError("terminated"),
                states.REVOKED)

        meta = finish.result.get("celery_meta") if isinstance(finish.result, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get("status"), str):
            # A Celery worker's own meta (celery_pulse.gateway.worker): its state, result
            # (an exception already in Celery's JSON form) and traceback, as it wrote them.
            return meta["status"], functools.partial(
                backend.store_result, attempt.task_id, meta.get("result"), meta["status"],
                traceback=meta.get("traceback"))
        if finish.outcome == "SUCCEEDED":
            return states.SUCCESS, functools.partial(
                backend.store_result, attempt.task_id, finish.result, states.SUCCESS)
        error = RemoteTaskError(f"{finish.error_code}: {json.dumps(finish.result)[:1000]}")
        return states.FAILURE, functools.partial(
            backend.store_result, attempt.task_id, error, states.FAILURE)


#: The most of a finish's result kept with its evidence (a stale or unstarted attempt's).
RETURNED_CHARS = 4096


def returned(finish: Finish) -> str | None:
    """What a finish reported, as kept with its evidence if it doesn't apply (the
    reviewer's only view of it): Celery's repr when the worker sent Celery's meta, else
    the result's JSON; None for a failure (its error code is kept instead)."""
    if finish.outcome != "SUCCEEDED":
        return None
    meta = finish.result.get("celery_meta") if isinstance(finish.result, dict) else None
    value = meta.get("result") if isinstance(meta, dict) else finish.result
    return json.dumps(value, sort_keys=True)[:RETURNED_CHARS]
