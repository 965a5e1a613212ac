"""Celery task ``Strategy`` factory: every delivered message is reserved before it runs.

``install(app)`` sets ``app.Task.Strategy`` to :func:`factory`. In a worker that
does not run the pulse pool it returns Celery's own strategy unchanged.
"""

from __future__ import annotations

from typing import Any

from celery.worker.strategy import default


def factory(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    pulse = getattr(consumer.controller, "pulse", None)
    if pulse is None:
        return default(task, app, consumer, **kwargs)
    intake = pulse.intake(consumer)
    # Celery's strategy sees the consumer with pulse's event dispatcher, so that the
    # task events of leased requests carry their attempt (celery_pulse.worker.events).
    return intake.wrap(task, default(task, app, intake.strategy_consumer(), **kwargs))
