"""Consumer step: keep the worker registered; pause consumption while fenced."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import __version__ as celery_version
from celery import bootsteps
from celery.worker import state as worker_state

from celery_pulse.registry import Membership
from celery_pulse.worker.exit_codes import EXIT_IDENTITY_LOST
from celery_pulse.worker.pool_controls import refuse_pool_controls

logger = logging.getLogger(__name__)


class _Listener:
    """Turns membership changes into consumer actions."""

    def __init__(self, consumer: Any, gate: Any) -> None:
        self.consumer = consumer
        self.gate = gate

    def on_fenced(self, reason: str) -> None:
        self.gate.close("registry: " + "fenced")

    def on_resumed(self) -> None:
        self.gate.open("registry: " + "fenced")

    def on_identity_lost(self, reason: str) -> None:
        self.gate.close("registry: identity lost")
        # The event loop checks this flag each turn and starts a warm shutdown:
        # in-flight tasks finish, then the process exits with this code.
        worker_state.should_stop = EXIT_IDENTITY_LOST

    def on_drain(self) -> None:
        logger.warning("pulse: drain requested: finishing in-flight tasks, then exiting")
        self.gate.close("drain")
        worker_state.should_stop = 0


def _keep_reservations_across_reconnects(c: Any, pulse: Any, pool: Any) -> None:
    """On a broker reconnect Celery drops requests not yet running (it expects the broker
    to redeliver them), but ours were acknowledged at reservation. Release them instead:
    Recover re-dispatches each at once, under a new epoch."""
    original = c.on_close

    def on_close() -> None:
        original()  # clears the worker's semaphore, and what waited in it
        pulse.exits.connection_lost("broker connection lost")
        pool.semaphore_cleared("broker connection lost while it waited for a pool process")

    c.on_close = on_close


def worker_labels(c: Any) -> dict[str, Any]:
    w = c.controller
    queues = sorted(c.app.amqp.queues.consume_from or c.app.amqp.queues)
    return {"queues": queues, "concurrency": w.concurrency, "pool": "pulse",
            "pid": os.getpid(), "celery": celery_version,
            "pulse": __import__("celery_pulse").__version__}


class Registry(bootsteps.StartStopStep):
    """Registers the worker at first start; keeps the gate applied across reconnects."""

    label = "pulse-registry"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def include_if(self, c: Any) -> bool:
        return getattr(c.controller, "pulse", None) is not None

    def start(self, c: Any) -> None:
        pulse = c.controller.pulse
        if pulse.membership is None:
            settings = pulse.settings
            pulse.bind(c)
            pulse.membership = Membership(
                pulse.store, c.hostname, worker_labels(c), ttl=settings.worker_ttl,
                interval=settings.heartbeat_interval, margin=settings.worker_margin,
                listener=_Listener(c, pulse.gate))
            pool = c.controller.pool
            pool.pulse = pulse
            pulse.ahead.hand_over = pool.hand_over
            pulse.waits.resume = pool.resume_waiting
            pulse.awaiting_process = pool.awaiting_process
            _keep_reservations_across_reconnects(c, pulse, pool)
            pulse.membership.start()
            pulse.start_leases()
            refuse_pool_controls(c)
        else:
            pulse.gate.reapply()
            # The loop turn the connection failed in may have dropped our drain.
            pulse.loop.rearm()
        pulse.attach_loop()

    def stop(self, c: Any) -> None:
        # A broker reconnect or a shutdown: membership goes on, but the event loop has
        # stopped, so the hot path goes back to the committer thread.
        c.controller.pulse.detach_loop()

    def shutdown(self, c: Any) -> None:
        # Deregistration waits for in-flight tasks (see PulseWorker.shutdown).
        c.controller.pulse.detach_loop()

    def info(self, c: Any) -> dict[str, Any]:
        return {"pulse": c.controller.pulse.info()}
