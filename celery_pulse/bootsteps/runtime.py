"""Worker step: read settings and open the store once, failing the start loudly.

It runs when the worker is built (before any message is consumed) and only when
the worker's pool is the pulse pool, and builds the worker service
(:class:`~celery_pulse.worker.service.PulseWorker`, defined there and re-exported
here). A bad setting, an unreachable store or a missing schema ends the process with
one line naming the setting or the command to run, and exit code 78 (EX_CONFIG).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from celery import bootsteps
from kombu.utils.imports import symbol_by_name

from celery_pulse.errors import InvalidConfig, PulseError
from celery_pulse.settings import Settings, refuse_unknown_task_options
from celery_pulse.store.sql import open_store
from celery_pulse.store.sql.engine import EngineOptions
from celery_pulse.store.sql.replication import check_replication
from celery_pulse.worker.exit_codes import EXIT_CONFIG, EXIT_IDENTITY_LOST
from celery_pulse.worker.permits import PermitRules
from celery_pulse.worker.pool_controls import refuse_autoscale
from celery_pulse.worker.service import BEAT_KEY, SWITCH_INTERVAL, PulseWorker

__all__ = ["BEAT_KEY", "EXIT_CONFIG", "EXIT_IDENTITY_LOST", "REDIS_RESTORE", "REDIS_VISIBILITY_MIN",
           "SWITCH_INTERVAL", "PulseWorker", "Runtime", "uses_pulse_pool"]

logger = logging.getLogger(__name__)

#: Shortest ``visibility_timeout`` pulse sets on Redis (seconds).
REDIS_VISIBILITY_MIN = 30.0
#: What else pulse sets on Redis, unless the user did: kombu's sweep of unacknowledged
#: deliveries on every tick of its 10 s timer (kombu's default scans on every 10th, so a
#: dead consumer's deliveries waited up to 100 s past ``visibility_timeout``), and the
#: sweep's lock held 60 s at most (kombu's default 300 s: a sweep cut by a Redis restart
#: left its lock behind and stopped every sweep for five minutes).
REDIS_RESTORE = {"unacked_restore_throttle": 1, "unacked_mutex_expire": 60}


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


def _short_redis_visibility(app: Any, settings: Settings) -> None:
    """On Redis, give a dead consumer's unacknowledged deliveries back within a minute.

    Under pulse only deliveries not reserved yet are unacknowledged (the few milliseconds
    before their reservation commits, or a store outage), and a copy delivered twice is
    refused by the claim table. Redis's default ``visibility_timeout`` (an hour) would
    leave a SIGKILLed worker's in-flight deliveries stuck that long, and kombu's default
    sweep (:data:`REDIS_RESTORE`) up to minutes more. Each value the user set is kept.
    """
    options = dict(app.conf.broker_transport_options or {})
    wanted = {"visibility_timeout": max(REDIS_VISIBILITY_MIN, 10 * settings.lease_ttl),
              **REDIS_RESTORE}
    if all(name in options for name in wanted):
        return
    try:
        with app.connection_for_read() as connection:  # not connected: only its transport
            driver = connection.transport.driver_type
    except Exception:  # an unknown transport: leave it alone
        return
    if driver == "redis":
        app.conf.broker_transport_options = {**wanted, **options}


def _gateway_store(w: Any, settings: Settings) -> tuple[Settings, Any]:
    """A gateway worker's store (its gateway connection, made now), and its settings with
    the gateway's lease: never a local deadline longer than the lease the store grants."""
    from celery_pulse.gateway.worker import GatewayStore, connect_worker

    queues = list(w.app.amqp.queues.consume_from or w.app.amqp.queues)
    if len(queues) != 1:
        raise InvalidConfig(f"pulse_gateway_url: a gateway worker consumes exactly one queue "
                            f"(-Q NAME), not {queues}", setting="pulse_gateway_url")
    # As a direct worker (and Celery): its prefetch of tasks waiting for a process, besides
    # the one running in each process (an instance's capacity counts both).
    multiplier = int(w.app.conf.worker_prefetch_multiplier or 0)
    capacity = min(256, max(1, w.concurrency * (multiplier + 1) if multiplier > 0
                            else w.concurrency))
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
            refuse_autoscale(w)
            refuse_unknown_task_options(w.app.tasks)
            rules = PermitRules.for_app(w.app, settings.concurrency_limits,
                                        settings.rate_limits)
            if settings.gateway_url:
                settings, store = _gateway_store(w, settings)
            else:
                store = open_store(settings.store_url, settings.store_connect_timeout,
                                   options=EngineOptions.of(settings, "worker"))
                # Asked now, while the store answers: the intake reads it on the event
                # loop for every delivery, where a store call must not block.
                store.max_message_bytes()
                check_replication(store.engine)  # warns of a standby commits don't wait for
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
        try:
            w.pulse.serve_metrics()
        except PulseError as exc:
            print(f"celery-pulse: cannot start: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG) from None
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
