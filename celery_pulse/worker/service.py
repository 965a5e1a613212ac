"""The worker service: what one ``-P pulse`` worker process holds, built by its steps.

:class:`~celery_pulse.bootsteps.runtime.Runtime` builds it when the worker is built
(settings read, store opened); :class:`~celery_pulse.bootsteps.registry.Registry` binds
it to the consumer and the pool and starts its threads (the lease keeper, Recover, beat,
chords, permit signals); the pool stops it after the last task (:meth:`PulseWorker.shutdown`).
It is the lease mechanism's listener (renewals, losses, hard stops, recoveries) and the
one place that acknowledges messages and sends pulse's worker events.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.beat import Beat
from celery_pulse.errors import NeedsReview, Terminal
from celery_pulse.leader import LeaderElector
from celery_pulse.leases import LOST, RESERVED, RUNNING, LeaseKeeper, LocalClaim
from celery_pulse.pool import child
from celery_pulse.pool.slots import DeadlineTable
from celery_pulse.recover import Recoverer
from celery_pulse.settings import Settings
from celery_pulse.store import records
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    LeaderGrant,
    Permit,
    Recovered,
)
from celery_pulse.worker.ahead import StartAhead
from celery_pulse.worker.chords import ChordFinisher
from celery_pulse.worker.cluster_metrics import ClusterReader, exporter_for
from celery_pulse.worker.events import WorkerEvents
from celery_pulse.worker.exits import RequestEnds, job_over
from celery_pulse.worker.gate import ConsumeGate
from celery_pulse.worker.intake import Intake
from celery_pulse.worker.loop import LoopCaller
from celery_pulse.worker.permit_signals import PermitSignals
from celery_pulse.worker.permit_waits import PermitWaits
from celery_pulse.worker.permits import PermitRules
from celery_pulse.worker.ports import Exits
from celery_pulse.worker.publish import republish
from celery_pulse.worker.schedules import EntrySource, publisher

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.runtime")

#: How long Recover waits for a lost attempt's end to be sent before re-publishing it.
ANNOUNCE_WAIT = 1.0

#: GIL switch interval in the worker's main process (seconds).
SWITCH_INTERVAL = 0.0005
#: The leader key this worker's beat campaigns for.
BEAT_KEY = "beat"


class PulseWorker:
    """What one worker process holds: settings, store, and the services the steps start.

    Also the adapter between the lease mechanism (:class:`LeaseKeeper`) and Celery:
    it acknowledges messages, signals pool children, sends events and keeps the
    prefetch limit, always on the consumer's event loop. The intake, the pool and the
    exits each see the slice of it named in :mod:`celery_pulse.worker.ports`.
    """

    def __init__(self, app: Any, hostname: str, concurrency: int, settings: Settings,
                 store: Any, rules: PermitRules | None = None, *, remote: bool = False) -> None:
        self.app = app
        #: A gateway worker (``pulse_gateway_url``): no Recover, beat or retention here.
        self.remote = remote
        self.hostname = hostname
        self.settings = settings
        self.store = store
        self.membership: Any = None
        self.consumer: Any = None
        self.gate: ConsumeGate | None = None
        self.loop: LoopCaller = LoopCaller(None)
        self.events = WorkerEvents(hostname, lambda: self.loop, lambda: self.consumer)
        self.stopping = False
        self._intake: Intake | None = None
        self._shut = False
        multiplier = int(app.conf.worker_prefetch_multiplier or 0)
        self.prefetch_limit = multiplier * max(1, concurrency) if multiplier > 0 else 0
        self.table = DeadlineTable()
        self.keeper = LeaseKeeper(store, hostname, ttl=settings.lease_ttl,
                                  interval=settings.renew_interval,
                                  margin=settings.safety_margin, grace=settings.revoke_grace,
                                  listener=self, checkpoints=self.table.checkpoints)
        self.ahead = StartAhead(self.keeper, lambda: self.loop, concurrency, lambda *_: None,
                                lambda permits: self.waits.waiting_for(permits))
        #: Cluster-wide concurrency limits, and the tasks of this worker waiting for one
        #: (``resume`` is the pool's, bound when the consumer starts).
        self.rules = rules or PermitRules(settings.concurrency_limits, settings.rate_limits)
        self.waits = PermitWaits(lambda: self.loop, lambda *_args: None, self.emit,
                                 settings.permit_wait_event)
        self.signals = PermitSignals(store, lambda keys: self.loop.call(self.waits.freed, keys))
        #: Retried starts waiting for a pool process (the pool's count, bound with it).
        self.awaiting_process: Callable[[], int] = lambda: 0
        child.configure(child.ChildContext(app, settings.store_url, hostname,
                                           settings.lease_ttl, self.table, settings))
        self.elector: LeaderElector | None = None
        self.beat: Beat | None = None
        if settings.beat:
            self.elector = LeaderElector(
                store, BEAT_KEY, hostname, ttl=settings.leader_ttl,
                interval=settings.leader_interval, margin=settings.leader_margin,
                on_gained=self._on_gained, on_lost=self._on_lost_leadership)
            source = EntrySource(app, store)
            self.beat = Beat(store, self.elector, entries=source,
                             publish=publisher(app, source.published),
                             catchup=settings.beat_catchup, now=store.now)
        #: The cluster's figures for Prometheus, and the election that picks the worker
        #: reading them when beat is off (:meth:`serve_metrics`).
        self.cluster: ClusterReader | None = None
        self.metrics_elector: LeaderElector | None = None
        #: Chords counted by this worker's completions (the ``pulse://`` backend).
        self.chords: ChordFinisher | None = None
        backend = app.backend if app.conf.result_backend else None
        if backend is not None and ChordFinisher.wanted(backend):
            self.chords = ChordFinisher(backend)
        self.recoverer = Recoverer(
            store, hostname, interval=settings.recover_interval, batch=settings.recover_batch,
            publish_ttl=max(5.0, settings.lease_ttl), retention=settings.retention,
            publish=lambda item: republish(app, item), listener=self,
            purge=self._purge, purge_every=settings.purge_interval, lag=store.retention_lag)
        #: One function per way Celery ends a request (:mod:`celery_pulse.worker.exits`).
        self.exits: Exits = RequestEnds(self)

    # -- binding to the consumer ------------------------------------------------
    def bind(self, consumer: Any) -> None:
        if self.consumer is consumer:
            return
        self.consumer = consumer
        self.gate = ConsumeGate(consumer, on_pause=self._requeue_waiting,
                                on_resume=self.admit_waiting)
        self.loop = LoopCaller(getattr(consumer, "hub", None))

    def intake(self, consumer: Any) -> Intake:
        self.bind(consumer)
        if self._intake is None:
            self._intake = Intake(self, consumer)
        return self._intake

    def start_leases(self) -> None:
        # The commit thread answers starts a free pool process waits for: it must not
        # wait Python's default 5 ms GIL switch interval behind the consumer loop.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self.keeper.start()
        if self.rules.declared:
            self.signals.start()
        if self.chords is not None:
            self.chords.start()
        if not self.remote:
            self.recoverer.start()
        if self.elector is not None and self.beat is not None:
            self.beat.start()
            self.elector.start()
        if self.cluster is not None:
            if self.metrics_elector is not None:
                self.metrics_elector.start()
            self.cluster.start()

    def serve_metrics(self) -> None:
        """Start the Prometheus exporter if ``pulse_metrics_port`` is set, at build time:
        an address it cannot listen on stops the start (:class:`InvalidConfig`)."""
        if not self.settings.metrics_port:
            return
        from celery_pulse.worker.metrics import serve

        if not self.remote:  # a gateway worker has no store to read the cluster from
            self.cluster, self.metrics_elector = exporter_for(self.store, self.elector,
                                                              self.hostname, self.settings)
        if not serve(self.settings.metrics_address, self.settings.metrics_port, self.info,
                     self.cluster):  # no prometheus_client: nobody would see a read
            self.cluster = self.metrics_elector = None

    def attach_loop(self) -> None:
        """The consumer's event loop is about to run: the hot path goes on it, where the
        store allows (:mod:`celery_pulse.loop_commit`)."""
        if self.loop.hub is not None and not self.stopping:
            self.keeper.attach_loop(self.loop.hub)

    def detach_loop(self) -> None:
        """The event loop stopped (a reconnect, a shutdown): back to the commit thread."""
        self.keeper.detach_loop()

    def _purge(self, older_than: float, budget: float) -> int | None:
        """Retention is the leader's job (any worker when beat is off)."""
        if self.elector is not None and not self.elector.is_leader:
            return None
        purged: int = self.store.purge_finished(older_than, budget=budget)
        if self.chords is not None:
            try:
                self.chords.recover()
            except Exception:
                logger.exception("pulse: recovering chords failed")
        return purged

    def _on_gained(self, grant: LeaderGrant) -> None:
        if self.beat is not None:
            self.beat.on_gained(grant)
        self.emit("pulse-leader-gained", key=grant.key, epoch=grant.epoch)

    def _on_lost_leadership(self, grant: LeaderGrant) -> None:
        self.emit("pulse-leader-lost", key=grant.key, epoch=grant.epoch)

    def permits(self, request: Any) -> tuple[Permit, ...]:
        """The concurrency permits a Celery request needs to start (none: unlimited)."""
        routing_key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
        return self.rules.needs(request.task, request.args, request.kwargs, routing_key)

    def waiting_for_permits(self) -> int:
        """Tasks waiting for a permit that don't count against the prefetch limit."""
        return min(self.waits.count, self.settings.permit_backlog)

    def claim_ended(self, task_id: str) -> None:
        """An attempt of ``task_id`` held here ended: deliveries waiting for it look."""
        if self._intake is not None:
            self._intake.claim_ended(task_id)

    def forget_deliveries(self) -> int:
        """After a broker reconnect: drop held deliveries (their tags are dead)."""
        return self._intake.forget_waiting() if self._intake is not None else 0

    def shutdown(self) -> None:
        """Called after in-flight tasks have finished (pool stopped): flush and deregister."""
        if self._shut:
            return
        self._shut = True
        self.stopping = True
        if self.beat is not None:
            self.beat.stop()
        if self.elector is not None:
            self.elector.stop()  # releases: the next leader ticks within one interval
        if not self.remote:
            self.recoverer.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.metrics_elector is not None:
            self.metrics_elector.stop()
        self.keeper.stop()
        self.signals.stop()
        if self.chords is not None:
            self.chords.stop()  # after the last completions counted their chords
        if self.membership is not None:
            self.membership.stop(deregister=True)

    # -- actions on the loop ------------------------------------------------------
    def ack(self, message: Any) -> None:
        try:
            message.ack()
        except Exception as exc:  # connection gone: the claim stands, we still run it
            logger.warning("pulse: could not acknowledge message (%r); the reservation "
                           "owns the task regardless", exc)

    def duplicate(self, task_id: str, name: str, holder: str | None, epoch: int,
                  why: str) -> None:
        self.keeper.counters.duplicates += 1
        logger.warning("pulse: duplicate delivery of %s[%s] dropped: %s (holder %s, epoch %d)",
                       name, task_id, why, holder, epoch)
        self.emit("pulse-duplicate-dropped", uuid=task_id, name=name, holder=holder,
                  epoch=epoch, reason=why)

    def exhausted(self, task_id: str, name: str, lost: Recovered | None = None) -> None:
        """The task used up its attempts (at a delivery, or when Recover took ``lost``):
        FAILURE in the result backend and in Flower (as the lost holder, if any)."""
        logger.error("pulse: %s[%s] used up its %s attempts: failed, not run", name, task_id,
                     "pulse_max_attempts")
        error = Terminal(f"attempt budget exhausted for task {task_id}: failed, not run")
        try:
            self.app.backend.mark_as_failure(task_id, error)
        except Exception:  # no result backend configured, or it is down
            logger.debug("pulse: could not record budget failure in the result backend",
                         exc_info=True)
        attempt = {} if lost is None else {"pulse_epoch": lost.epoch - 1,
                                           "pulse_attempt": lost.attempts}
        self.events.emit("task-failed", hostname=lost.holder if lost else None, uuid=task_id,
                         exception=repr(error), traceback=None, **attempt)

    def emit(self, event: str, **fields: Any) -> None:
        """Send a worker event (only when events are enabled), on the loop thread."""
        self.events.emit(event, **fields)

    def admit_waiting(self) -> None:
        """Room under the prefetch limit may have opened: reserve held deliveries.

        Never while consumption is paused (fenced, draining, store down): those were
        given back to the broker when it paused.
        """
        if not self.prefetch_limit or self._intake is None:
            return
        if self._intake.paused_at_limit:
            self._intake.reopen_if_room()
        if self._intake.waiting and (self.gate is None or self.gate.is_open):
            self._intake.drain_waiting()

    def _requeue_waiting(self) -> None:
        if self._intake is not None:
            self._intake.requeue_waiting()

    # -- LeaseListener (renewer thread) ----------------------------------------------
    def on_renewed(self, claims: Sequence[LocalClaim]) -> None:
        for claim in claims:
            if claim.slot is not None:
                self.table.write(claim.slot, claim.task_id, claim.deadline, False)

    def on_lost(self, claim: LocalClaim) -> None:
        if claim.slot is not None:
            self.table.write(claim.slot, claim.task_id, claim.deadline, True)
        if claim.pid is not None:
            self._signal(claim.pid, child.LEASE_SIGNAL)
        self.emit("pulse-lease-lost", uuid=claim.task_id, epoch=claim.epoch,
                  reason=claim.lost_reason, running=claim.pid is not None)

    def on_hard_stop(self, claim: LocalClaim) -> None:
        if claim.pid is not None and not job_over(claim):
            self._signal(claim.pid, signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    # -- RecoverListener (recover thread) --------------------------------------------
    def on_redispatching(self, item: Recovered) -> None:
        """Before Recover re-publishes ``item``: its lost attempt ends in Flower as
        retried (Celery's ``task-retried``, as the lost holder), before the new attempt's
        events can arrive."""
        if item.was == OPEN or item.holder is None:
            return  # taken from a scanner that died before publishing: no attempt to end
        lost = item.epoch - 1
        # A ``reason``, not an ``exception``: Flower keeps a task's last exception through
        # its later states, and the attempt that succeeds next raised nothing.
        what = ("lost its lease" if item.was == records.RUNNING
                else "never started it (reservation expired or released)")
        self.events.emit("task-retried", hostname=item.holder, wait=ANNOUNCE_WAIT,
                         uuid=item.task_id, pulse_epoch=lost, pulse_attempt=item.attempts,
                         reason=f"holder {item.holder} {what} at epoch {lost}: re-dispatched")

    def on_recovered(self, item: Recovered) -> None:
        if item.state == FAILED:
            self.exhausted(item.task_id, item.task_name, item)
        elif item.state == NEEDS_REVIEW:
            # The lost attempt's outcome is unknown: Flower shows it failed, saying so.
            lost = item.epoch - 1
            reason = NeedsReview(f"holder {item.holder} lost its lease at epoch {lost}; "
                                 "outcome unknown: celery pulse review")
            self.events.emit("task-failed", hostname=item.holder, uuid=item.task_id,
                             exception=repr(reason), traceback=None, pulse_epoch=lost,
                             pulse_attempt=item.attempts)
        event = "pulse-needs-review" if item.state == NEEDS_REVIEW else "pulse-task-recovered"
        self.emit(event, uuid=item.task_id, name=item.task_name, epoch=item.epoch,
                  state=item.state, was=item.was, holder=item.holder)

    # -- stats -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """The ``pulse`` section of the worker's stats (``celery inspect stats``)."""
        counters = self.keeper.counters
        held = self.keeper.snapshot()
        membership = self.membership
        return {
            "worker_id": self.hostname,
            "store": self.store.url,
            "registration": None if membership is None else {
                "state": membership.state,
                "expires_in": round(membership.expires_in, 3)},
            "consuming": self.gate.is_open if self.gate else None,
            "paused_for": sorted(self.gate.reasons) if self.gate else [],
            "permits": {"waiting": self.waits.count, "by_key": self.waits.by_key(),
                        "awaiting_process": self.awaiting_process(),
                        **self.ahead.stats()},
            "leases": {"held": sum(c.state != LOST for c in held),
                       "running": sum(c.state == RUNNING for c in held),
                       "reserved": sum(c.state == RESERVED for c in held),
                       "prefetch_limit": self.prefetch_limit},
            "renew_latency": counters.latency_percentiles(),
            "counts": {"reserved": counters.reserved, "duplicates": counters.duplicates,
                       "lost": counters.lost, "hard_stopped": counters.hard_stopped,
                       "completed": counters.completed,
                       "stale_completions": counters.stale_completions,
                       "renewals": counters.renewals, "renew_failures": counters.renew_failures,
                       "store_errors": counters.store_errors,
                       "contended": counters.contended, "checkpoints": counters.checkpoints,
                       "exchanges": counters.exchanges,
                       "exchanged_ops": counters.exchanged_ops,
                       "rejected": counters.rejected, **self.store.hot_path_counts()},
            "recover": dict(self.recoverer.counts), "retention": self.recoverer.retention_stats(),
            "leader": None if self.elector is None else {
                "key": BEAT_KEY, "is_leader": self.elector.is_leader,
                "epoch": self.elector.epoch, "since": self.elector.since,
                "slots_fired": self.beat.fired if self.beat else 0},
        }
