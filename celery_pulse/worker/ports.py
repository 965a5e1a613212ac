"""What each part of the Celery edge needs of the worker service, as typed interfaces.

The worker service (:class:`~celery_pulse.worker.service.PulseWorker`) is the one object
that holds a worker's lease keeper, loop, gate, permits and event dispatcher. Its
clients each see only the slice named here, so the route of a claim through a worker
reads from these Protocols, in order:

1. **Intake** (:class:`WorkerForIntake`, :mod:`celery_pulse.worker.intake`): a delivery
   is screened, held under the prefetch limit (``prefetch_limit``,
   ``waiting_for_permits``, ``gate``) or reserved (``keeper.submit_reserve``, the start
   folded in by ``ahead``); granted, it is acknowledged (``ack``) and handed to Celery's
   strategy with ``on_ack``/``on_reject`` bound to the claim
   (:class:`~celery_pulse.worker.verdict.CeleryVerdict`, which tells :class:`Exits`);
   refused, it is dropped (``duplicate``, ``exhausted``).
2. **Pool** (:class:`WorkerForPool`, :mod:`celery_pulse.pool.prefork`): Celery hands the
   request to the pool; the claim is started (``keeper``, ``ahead``, permits waited for
   in ``waits``), given a deadline slot (``table``) and written to a process; a lost
   lease signals it (``on_lost``).
3. **Exits** (:class:`Exits`, :mod:`celery_pulse.worker.exits`): however Celery ends the
   request, one function ends the claim (:class:`WorkerForExits`: the completion,
   requeue, or forgetting it), and deliveries waiting for room or for this task's end
   look again (``claim_ended``, ``admit_waiting``).
"""

from __future__ import annotations

from typing import Any, Protocol

from celery_pulse.leases import LeaseKeeper, LocalClaim
from celery_pulse.pool.slots import DeadlineTable
from celery_pulse.recover import Recoverer
from celery_pulse.settings import Settings
from celery_pulse.store.base import Permit
from celery_pulse.worker.ahead import StartAhead
from celery_pulse.worker.chords import ChordFinisher
from celery_pulse.worker.gate import ConsumeGate
from celery_pulse.worker.loop import LoopCaller
from celery_pulse.worker.permit_signals import PermitSignals
from celery_pulse.worker.permit_waits import PermitWaits
from celery_pulse.worker.permits import PermitRules


class Exits(Protocol):
    """The ways a leased request ends that the intake and the pool report (one function
    each in :class:`~celery_pulse.worker.exits.RequestEnds`, by the table of exits in
    docs/concepts/leases.md)."""

    def verdict(self, claim: LocalClaim, kind: str, requeue: bool) -> None:
        """Celery acknowledged (``kind`` "ack") or rejected ("reject") the request."""

    def refused_by_strategy(self, claim: LocalClaim, exc: BaseException) -> None:
        """Celery's strategy raised on the request: it will never run."""

    def revoked_while_waiting(self, claim: LocalClaim) -> None:
        """Celery marked the request revoked or expired while its start was retried."""

    def not_run(self, claim: LocalClaim, request: Any, why: str) -> None:
        """pulse drops a job before its body runs (lease lost, start refused)."""

    def ran(self, claim: LocalClaim, exc: Any, failed: bool) -> None:
        """The pool reported the attempt's end: its outcome, by what Celery decided."""

    def lost_attempt_stopped(self, claim: LocalClaim) -> None:
        """A stale attempt's process died (hard-stopped, or killed after its loss)."""

    def connection_lost(self, why: str) -> None:
        """The broker connection dropped: Celery forgot every request not yet running."""


class WorkerForIntake(Protocol):
    """What the intake needs of the worker: reserve, acknowledge, hold, drop."""

    settings: Settings
    keeper: LeaseKeeper
    loop: LoopCaller
    gate: ConsumeGate | None
    rules: PermitRules
    ahead: StartAhead
    exits: Exits
    #: ``worker_prefetch_multiplier x concurrency`` (0: no limit).
    prefetch_limit: int
    stopping: bool

    def waiting_for_permits(self) -> int:
        """Tasks waiting for a permit that don't count against the prefetch limit."""

    def permits(self, request: Any) -> tuple[Permit, ...]:
        """The permits a Celery request needs to start (none: unlimited)."""

    def ack(self, message: Any) -> None:
        """Acknowledge a reserved delivery to the broker (a failure is only logged)."""

    def duplicate(self, task_id: str, name: str, holder: str | None, epoch: int,
                  why: str) -> None:
        """A delivery of a task held already (here or elsewhere): logged, counted, sent."""

    def exhausted(self, task_id: str, name: str) -> None:
        """A delivery whose task used up its attempts: failed, not run."""

    def admit_waiting(self) -> None:
        """Room under the prefetch limit may have opened: reserve held deliveries."""


class WorkerForPool(Protocol):
    """What the pool needs of the worker: start a claim, hand it over, report its end."""

    keeper: LeaseKeeper
    loop: LoopCaller
    ahead: StartAhead
    waits: PermitWaits
    table: DeadlineTable
    exits: Exits
    stopping: bool

    def permits(self, request: Any) -> tuple[Permit, ...]:
        """The concurrency permits a Celery request needs to start (none: unlimited)."""

    def on_lost(self, claim: LocalClaim) -> None:
        """Tell the process running ``claim`` that its lease is lost."""

    def admit_waiting(self) -> None:
        """Room under the prefetch limit may have opened: reserve held deliveries."""

    def shutdown(self) -> None:
        """In-flight tasks have finished (the pool stopped): flush and deregister."""


class WorkerForExits(Protocol):
    """What ending a claim touches: the keeper's books and the services that follow."""

    keeper: LeaseKeeper
    loop: LoopCaller
    ahead: StartAhead
    waits: PermitWaits
    signals: PermitSignals
    table: DeadlineTable
    chords: ChordFinisher | None
    recoverer: Recoverer
    #: A gateway worker: its requeues are the gateway's (the lease expires there).
    remote: bool

    def claim_ended(self, task_id: str) -> None:
        """An attempt of ``task_id`` held here ended: deliveries waiting for it look."""

    def forget_deliveries(self) -> int:
        """After a broker reconnect: drop held deliveries (their tags are dead)."""

    def admit_waiting(self) -> None:
        """Room under the prefetch limit may have opened: reserve held deliveries."""
