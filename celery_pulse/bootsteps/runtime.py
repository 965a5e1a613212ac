"""Worker step: read settings and open the store once, failing the start loudly.

It runs when the worker is built (before any message is consumed) and only when
the worker's pool is the pulse pool. A bad setting, an unreachable store or a
missing schema ends the process with one line naming the setting or the command
to run, and exit code 78 (EX_CONFIG).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from celery import bootsteps
from kombu.utils.imports import symbol_by_name

from celery_pulse.beat import Beat
from celery_pulse.bootsteps.ahead import StartAhead
from celery_pulse.bootsteps.chords import ChordFinisher
from celery_pulse.bootsteps.gate import ConsumeGate
from celery_pulse.bootsteps.intake import Intake
from celery_pulse.bootsteps.loop import LoopCaller
from celery_pulse.bootsteps.permits import PermitRules, PermitSignals, PermitWaits
from celery_pulse.bootsteps.publish import republish
from celery_pulse.bootsteps.schedules import EntrySource, publisher
from celery_pulse.errors import PulseError
from celery_pulse.leader import LeaderElector
from celery_pulse.leases import LOST, RESERVED, RUNNING, LeaseKeeper, LocalClaim
from celery_pulse.pool import child
from celery_pulse.pool.slots import DeadlineTable
from celery_pulse.recover import Recoverer
from celery_pulse.settings import Settings, refuse_unknown_task_options
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    REVOKED,
    LeaderGrant,
    Permit,
    Recovered,
)
from celery_pulse.store.sql import open_store

logger = logging.getLogger(__name__)

#: Shortest ``visibility_timeout`` pulse sets on Redis (seconds).
REDIS_VISIBILITY_MIN = 30.0
#: GIL switch interval in the worker's main process (seconds).
SWITCH_INTERVAL = 0.0005

EXIT_CONFIG = 78
BEAT_KEY = "beat"
EXIT_IDENTITY_LOST = 3


def uses_pulse_pool(worker: Any) -> bool:
    """True if ``worker`` runs the pulse pool (class or alias)."""
    from celery import concurrency

    from celery_pulse.pool.prefork import TaskPool

    pool_cls = worker.pool_cls
    if isinstance(pool_cls, str):
        try:
            pool_cls = symbol_by_name(pool_cls, concurrency.ALIASES)
        except (ImportError, AttributeError, ValueError):
            return False
    return isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool)


class PulseWorker:
    """What one worker process holds: settings, store, and the services the steps start.

    Also the adapter between the lease mechanism (:class:`LeaseKeeper`) and Celery:
    it acknowledges messages, signals pool children, sends events and keeps the
    prefetch limit, always on the consumer's event loop.
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
        self.stopping = False
        self._intake: Intake | None = None
        self._shut = False
        multiplier = int(app.conf.worker_prefetch_multiplier or 0)
        self.prefetch_limit = multiplier * max(1, concurrency) if multiplier > 0 else 0
        self.table = DeadlineTable()
        self.keeper = LeaseKeeper(store, hostname, ttl=settings.lease_ttl,
                                  interval=settings.renew_interval,
                                  margin=settings.safety_margin, grace=settings.revoke_grace,
                                  listener=self)
        self.ahead = StartAhead(self.keeper, lambda: self.loop, concurrency,
                                lambda *_args: None)
        #: Cluster-wide concurrency limits, and the tasks of this worker waiting for one
        #: (``resume`` is the pool's, bound when the consumer starts).
        self.rules = rules or PermitRules(settings.concurrency_limits)
        self.waits = PermitWaits(lambda: self.loop, lambda *_args: None, self.emit,
                                 settings.permit_wait_event)
        self.signals = PermitSignals(store, lambda keys: self.loop.call(self.waits.freed, keys))
        #: Retried starts waiting for a pool process (the pool's count, bound with it).
        self.awaiting_process: Callable[[], int] = lambda: 0
        child.configure(child.ChildContext(app, settings.store_url, hostname,
                                           settings.lease_ttl, self.table))
        self.elector: LeaderElector | None = None
        self.beat: Beat | None = None
        if settings.beat:
            self.elector = LeaderElector(
                store, BEAT_KEY, hostname, ttl=settings.leader_ttl,
                interval=settings.leader_interval, margin=settings.leader_margin,
                on_gained=self._on_gained, on_lost=self._on_lost_leadership)
            self.beat = Beat(store, self.elector, entries=EntrySource(app, store),
                             publish=publisher(app), catchup=settings.beat_catchup,
                             now=store.now)
        #: Chords counted by this worker's completions (the ``pulse://`` backend).
        self.chords: ChordFinisher | None = None
        backend = app.backend if app.conf.result_backend else None
        if backend is not None and ChordFinisher.wanted(backend):
            self.chords = ChordFinisher(backend)
        self.recoverer = Recoverer(
            store, hostname, interval=settings.recover_interval, batch=settings.recover_batch,
            publish_ttl=max(5.0, settings.lease_ttl), retention=settings.retention,
            publish=lambda item: republish(app, item), listener=self,
            purge=self._purge)

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
        if self.settings.metrics_port:
            from celery_pulse.bootsteps.metrics import serve

            serve(self.settings.metrics_port, self.info)

    def attach_loop(self) -> None:
        """The consumer's event loop is about to run: the hot path goes on it, where the
        store allows (:mod:`celery_pulse.loop_commit`)."""
        if self.loop.hub is not None and not self.stopping:
            self.keeper.attach_loop(self.loop.hub)

    def detach_loop(self) -> None:
        """The event loop stopped (a reconnect, a shutdown): back to the commit thread."""
        self.keeper.detach_loop()

    def release_unstarted(self, why: str) -> None:
        """Give up every reservation not yet started (Celery dropped their requests)."""
        if self._intake is not None:
            self._intake.forget_waiting()
        released = self.keeper.release_unstarted(why)
        if released:
            logger.warning("pulse: %d reservation(s) released for immediate re-dispatch: %s",
                           released, why)

    def _purge(self, older_than: float) -> int:
        """Retention is the leader's job (any worker when beat is off)."""
        if self.elector is not None and not self.elector.is_leader:
            return 0
        purged: int = self.store.purge_finished(older_than)
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

    # -- how Celery ends a request (on the loop) -----------------------------------------
    def celery_verdict(self, claim: LocalClaim, kind: str, requeue: bool) -> None:
        """Celery acknowledged (``ack``) or rejected (``reject``) a leased request.

        An ack before the job went to the pool means Celery dropped the request (its id
        is revoked, or it expired): the claim ends ``revoked``. A reject of a job in the
        pool is remembered for the pool's result callback, which ends the claim; one
        before the pool ends it now. A lost claim is left to the store (Recover).
        """
        if claim.state == LOST:
            return
        if kind == "ack":
            if not claim.applied:
                self.end_unstarted(claim, REVOKED, "revoked or expired before it ran")
            return
        if claim.applied:
            claim.verdict = "requeue" if requeue else "reject"
        elif requeue:
            self.requeue(claim)
        else:
            self.end_unstarted(claim, FAILED, "rejected by Celery before it ran")

    def permits(self, request: Any) -> tuple[Permit, ...]:
        """The concurrency permits a Celery request needs to start (none: unlimited)."""
        routing_key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
        return self.rules.needs(request.task, request.args, request.kwargs, routing_key)

    def waiting_for_permits(self) -> int:
        """Tasks waiting for a permit that don't count against the prefetch limit."""
        return min(self.waits.count, self.settings.permit_backlog)

    def end_unstarted(self, claim: LocalClaim, outcome: str, why: str) -> None:
        """End a claim whose request Celery will never run, so it is never renewed again."""
        logger.info("pulse: task %s epoch %d ends %s: %s", claim.task_id, claim.epoch,
                    outcome, why)
        self.complete(claim, outcome, why)

    def complete(self, claim: LocalClaim, outcome: str, error: str | None) -> None:
        """Record the claim's outcome; deliveries waiting for its end look again after."""
        task_id = claim.task_id
        part = claim.chord_part
        permits = claim.permits if claim.state == RUNNING else None

        def done(_answer: Any, counted: tuple[int, str] | None) -> None:
            self.loop.call(self.claim_ended, task_id)
            if permits:  # given back with the completion: its waiters ask now
                self.loop.call(self.waits.freed, {p.key for p in permits})
                self.signals.announce(permits)
            if counted is not None and part is not None and self.chords is not None:
                self.chords.counted(part, *counted)

        self.keeper.submit_complete(claim, outcome, error, done)
        self.ahead.left(claim)
        self.admit_waiting()

    def requeue(self, claim: LocalClaim) -> None:
        """Celery's requeue: the task goes back to the broker as a new attempt (epoch + 1).

        The store moves the claim to ``open`` under this worker's publish lease and the
        recover thread publishes the stored message, as Recover does; if this worker dies
        in between, Recover publishes it once the publish lease expires.
        """
        self.keeper.forget(claim)
        self.ahead.left(claim)
        if not self.remote:  # a gateway worker's lease expires there, and Recover acts
            self.recoverer.requeue(claim.key)
        logger.info("pulse: task %s epoch %d requeued by Celery", claim.task_id, claim.epoch)
        self.claim_ended(claim.task_id)
        self.admit_waiting()

    def claim_ended(self, task_id: str) -> None:
        if self._intake is not None:
            self._intake.claim_ended(task_id)

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

    def exhausted(self, task_id: str, name: str) -> None:
        logger.error("pulse: %s[%s] used up its %s attempts: failed, not run", name, task_id,
                     "pulse_max_attempts")
        try:
            from celery_pulse.errors import Terminal

            self.app.backend.mark_as_failure(
                task_id, Terminal(f"attempt budget exhausted for task {task_id}"))
        except Exception:  # no result backend configured, or it is down
            logger.debug("pulse: could not record budget failure in the result backend",
                         exc_info=True)

    def emit(self, event: str, **fields: Any) -> None:
        """Send a worker event (only when events are enabled), on the loop thread."""
        consumer = self.consumer
        dispatcher = getattr(consumer, "event_dispatcher", None)
        if dispatcher is None or not getattr(dispatcher, "enabled", False):
            return

        def send() -> None:
            try:
                dispatcher.send(event, hostname=self.hostname, **fields)
            except Exception:
                logger.debug("pulse: could not send %s event", event, exc_info=True)
        self.loop.call(send)

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
        if claim.pid is not None:
            self._signal(claim.pid, signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    # -- RecoverListener (recover thread) --------------------------------------------
    def on_recovered(self, item: Recovered) -> None:
        if item.state == FAILED:
            self.exhausted(item.task_id, item.task_name)
        event = "pulse-needs-review" if item.state == NEEDS_REVIEW else "pulse-task-recovered"
        self.emit(event, uuid=item.task_id, name=item.task_name, epoch=item.epoch,
                  state=item.state, was=item.was)

    # -- stats -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        counters = self.keeper.counters
        with self.keeper._lock:
            held = list(self.keeper.claims.values())
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
                        "awaiting_process": self.awaiting_process()},
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
                       "contended": counters.contended,
                       "exchanges": counters.exchanges,
                       "exchanged_ops": counters.exchanged_ops,
                       "rejected": counters.rejected},
            "recover": dict(self.recoverer.counts),
            "leader": None if self.elector is None else {
                "key": BEAT_KEY, "is_leader": self.elector.is_leader,
                "epoch": self.elector.epoch, "since": self.elector.since,
                "slots_fired": self.beat.fired if self.beat else 0},
        }


def _short_redis_visibility(app: Any, settings: Settings) -> None:
    """On Redis, give a dead consumer's unacknowledged deliveries back within minutes.

    Under pulse only deliveries not reserved yet are unacknowledged (the few milliseconds
    before their reservation commits, or a store outage), and a copy delivered twice is
    refused by the claim table. Redis's default ``visibility_timeout`` (an hour) would
    leave a SIGKILLed worker's in-flight deliveries stuck that long. A value the user set
    is kept.
    """
    options = dict(app.conf.broker_transport_options or {})
    if "visibility_timeout" in options:
        return
    try:
        with app.connection_for_read() as connection:  # not connected: only its transport
            driver = connection.transport.driver_type
    except Exception:  # an unknown transport: leave it alone
        return
    if driver == "redis":
        options["visibility_timeout"] = max(REDIS_VISIBILITY_MIN, 10 * settings.lease_ttl)
        app.conf.broker_transport_options = options


def _gateway_store(w: Any, settings: Settings) -> tuple[Settings, Any]:
    """A gateway worker's store (its gateway connection, made now), and its settings with
    the gateway's lease: never a local deadline longer than the lease the store grants."""
    from celery_pulse.errors import InvalidConfig
    from celery_pulse.gateway.worker import GatewayStore, connect_worker

    queues = list(w.app.amqp.queues.consume_from or w.app.amqp.queues)
    if len(queues) != 1:
        raise InvalidConfig(f"pulse_gateway_url: a gateway worker consumes exactly one queue "
                            f"(-Q NAME), not {queues}", setting="pulse_gateway_url")
    if settings.concurrency_limits or any(getattr(t, "pulse_concurrency", None)
                                          for t in w.app.tasks.values()):
        raise InvalidConfig("pulse_gateway_url: concurrency limits need a direct worker",
                            setting="pulse_gateway_url")
    multiplier = int(w.app.conf.worker_prefetch_multiplier or 0)
    capacity = min(256, max(1, w.concurrency * multiplier if multiplier > 0 else w.concurrency))
    handlers = [name for name in w.app.tasks if not name.startswith("celery.")]
    client = connect_worker(settings, queues[0], capacity, handlers)
    ttl = min(settings.lease_ttl, client.lease_duration)
    settings = dataclasses.replace(settings, lease_ttl=ttl, beat=False,
                                   renew_interval=min(settings.renew_interval, ttl / 3))
    return settings, GatewayStore(client, settings.gateway_url or "")


class Runtime(bootsteps.StartStopStep):
    """Builds ``worker.pulse`` (a :class:`PulseWorker`) or stops the process."""

    label = "pulse"
    requires = ("celery.worker.components:Pool",)

    def include_if(self, w: Any) -> bool:
        return uses_pulse_pool(w)

    def create(self, w: Any) -> Any:
        try:
            settings = Settings.from_conf(w.app.conf)
            refuse_unknown_task_options(w.app.tasks)
            rules = PermitRules.for_app(w.app, settings.concurrency_limits)
            if settings.gateway_url:
                settings, store = _gateway_store(w, settings)
            else:
                store = open_store(settings.store_url, settings.store_connect_timeout)
                # Asked now, while the store answers: the intake reads it on the event
                # loop for every delivery, where a store call must not block.
                store.max_message_bytes()
        except PulseError as exc:
            # Logging may not be set up yet: one plain line on stderr, no traceback.
            print(f"celery-pulse: cannot start: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG) from None
        if getattr(w, "beat", None) and settings.beat:
            logger.warning("pulse: this worker also runs Celery's own beat (-B) while "
                           "pulse_beat is on: every slot may fire twice. Drop -B; pulse's "
                           "leader-elected beat already runs in every -P pulse worker.")
        _short_redis_visibility(w.app, settings)
        w.pulse = PulseWorker(w.app, w.hostname, w.concurrency, settings, store, rules,
                              remote=bool(settings.gateway_url))
        return self

    def start(self, w: Any) -> None:
        pass

    def stop(self, w: Any) -> None:
        # Not here: this step stops before the pool, and leases must keep being renewed
        # (and completions written) while in-flight tasks finish. The pulse pool shuts
        # pulse down from its own on_stop, after the children are done.
        pass

    def terminate(self, w: Any) -> None:
        pass
