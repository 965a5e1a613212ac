"""Celery's pool controls (Flower's Pool tab) that ``-P pulse`` refuses, and why.

``pool_grow``, ``pool_shrink``, ``autoscale`` and ``pool_restart`` would resize or
restart the prefork pool under the worker's leases, while what the leases rely on is
sized once, from ``-c``, when the worker starts: the prefetch limit that bounds the
reservations this worker holds, the starts taken ahead of the pool, the permit backlog.
A resized pool would hold more reservations than it can run (or run more than it
reserved room for), and a restarted process kills the task whose lease it holds.
So each is refused with a reply that says why (``{"error": ...}``, which
``celery control`` and Flower show as they are) and one WARNING line; ``--autoscale``
is refused at startup (:func:`refuse_autoscale`). Resize by restarting the worker:
``celery pulse drain NAME --wait``, then start it with the new ``-c``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery_pulse.errors import InvalidConfig

logger = logging.getLogger(__name__)

#: How to resize instead.
INSTEAD = ("resize by restarting the worker with a new -c (celery pulse drain NAME --wait, "
           "then start it again)")

#: Command -> why -P pulse refuses it.
REFUSED: dict[str, str] = {
    "pool_grow": "the worker's leases are sized from -c at startup (prefetch limit, starts "
                 "ahead, permit backlog)",
    "pool_shrink": "the worker's leases are sized from -c at startup (prefetch limit, starts "
                   "ahead, permit backlog)",
    "autoscale": "the worker's leases are sized from -c at startup (prefetch limit, starts "
                 "ahead, permit backlog)",
    "pool_restart": "restarting pool processes would kill the tasks whose leases they hold",
}


def refusal(command: str) -> str:
    """The reply's text for ``command``."""
    return f"{command} is not supported by -P pulse: {REFUSED[command]}; {INSTEAD}"


def _refuse(command: str) -> Callable[..., dict[str, str]]:
    def handler(state: Any, **arguments: Any) -> dict[str, str]:
        text = refusal(command)
        logger.warning("pulse: refused remote control command %s%r: %s", command,
                       arguments or {}, text)
        return {"error": text}
    handler.__name__ = command
    return handler


def refuse_pool_controls(consumer: Any) -> bool:
    """Answer the pool controls of ``consumer``'s remote-control node with a refusal.

    The node shares Celery's global handler table (``Panel.data``): it gets a copy with
    ours in it, so other workers of the process (tests) keep Celery's. False if the
    consumer has no remote control (``--without-control``: nothing to refuse).
    """
    for step in getattr(getattr(consumer, "blueprint", None), "steps", {}).values():
        node = getattr(getattr(step, "box", None), "node", None)
        if node is not None and isinstance(getattr(node, "handlers", None), dict):
            node.handlers = {**node.handlers, **{name: _refuse(name) for name in REFUSED}}
            return True
    return False


def refuse_autoscale(worker: Any) -> None:
    """Raise :class:`InvalidConfig` if the worker was started with ``--autoscale``."""
    if getattr(worker, "autoscale", None):
        raise InvalidConfig(f"--autoscale is not supported by -P pulse: {REFUSED['autoscale']}; "
                            f"size the pool with -c (--concurrency)",
                            setting=None)
