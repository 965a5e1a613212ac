"""``task.query``: a remote worker asks what became of a task (seed 003's attempt and
evidence queries), as ``celery pulse attempts`` shows an operator.

The rules, before any code:

* **Read-only, and only the instance's own queue.** The answer is the claim (its state
  and epoch), every attempt gateways assigned (epoch, attempt id, when, whether it is
  the current one, whether this instance holds it) and the late outcomes kept as
  evidence (epoch, outcome, error, when, whether they were this instance's). A task whose
  claim is on another queue, or that has none, is ``NOT_FOUND``: a credential learns
  nothing of a queue it can't consume. Holder names and secrets of other instances are
  never shown.
* **Named by the protocol's task id** (32 hex). A Celery id that is a UUID is its hex;
  another is found while the gateway remembers an attempt of it for this instance.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery_pulse.gateway.protocol import Code, ProtocolError, TaskQuery
from celery_pulse.gateway.receipts import timestamp
from celery_pulse.gateway.session import Instance
from celery_pulse.store.base import Store
from celery_pulse.store.gateway_state import GatewayState, current_attempt

T = TypeVar("T")


def candidates(instance: Instance, wire_id: str) -> list[str]:
    """The Celery task ids the protocol's ``wire_id`` may stand for."""
    out = [a.task_id for a in list(instance.attempts.values()) if a.wire_task_id == wire_id]
    out.append(str(uuid.UUID(hex=wire_id)))  # 32 hex: the codec checked it
    return list(dict.fromkeys(out))


def answer(store: Store, state: GatewayState, instance: Instance, holder: str,
           query: TaskQuery) -> dict[str, Any] | None:
    """The query's answer (blocking: store reads); None: not found on this queue."""
    for task_id in candidates(instance, query.task_id):
        detail = store.claim_detail(task_id)
        if detail is None or detail.claim.queue != instance.identity.queue_id:
            continue
        claim = detail.claim
        return {
            "task_id": query.task_id, "task_state": claim.state.upper(),
            "epoch": str(claim.epoch),
            "attempts": [{"attempt_id": record.attempt_id, "epoch": str(record.epoch),
                          "assigned_at": timestamp(at),
                          "current": current_attempt(record, claim.state, claim.epoch),
                          "mine": record.instance_id == instance.instance_id}
                         for record, at in state.attempts_of(task_id)],
            "evidence": [{"epoch": str(e.epoch), "outcome": e.outcome.upper(),
                          "error": (e.error or "")[:1024], "recorded_at": timestamp(
                              e.recorded_at), "mine": e.holder == holder}
                         for e in detail.evidence],
            "deduplicated": False}
    return None


class Queries:
    """The gateway's ``task.query`` (a mixin of its operations)."""

    store: Store | None
    state: GatewayState | None
    _holders: dict[str, str]

    if TYPE_CHECKING:
        async def _store(self, call: Callable[..., T], *args: Any) -> T: ...

    async def _query(self, instance: Instance, query: TaskQuery) -> dict[str, Any]:
        found = None
        if self.store is not None and self.state is not None:
            found = await self._store(answer, self.store, self.state, instance,
                                      self._holders[instance.instance_id], query)
        if found is None:
            raise ProtocolError(Code.NOT_FOUND, "no such task on this queue")
        return found
