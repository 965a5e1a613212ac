"""``task.cancel``: Celery's revoke reaching a remote worker, as its own remote control.

A Celery worker learns of ``revoke`` (``AsyncResult.revoke()``, ``celery control
revoke``) from a broadcast on its broker; a remote worker has no broker, so its gateway
consumes the broadcast for it (:mod:`.revokes`) and sends ``task.cancel`` for each
attempt of a revoked task it holds. The worker's client turns the frame into the very
control message Celery's broadcast carries, and the ``pulsegw://`` transport delivers it
on the worker's pidbox queue: Celery's own ``revoke`` handler does the rest (the
revoked set, a request not run, ``terminate`` with its signal), exactly as on a direct
worker. Nothing else of remote control reaches a remote worker.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping
from typing import Any

#: The suffix of a Celery worker's remote-control queue (``<hostname>.celery.pidbox``,
#: ``celery`` being the app's ``control_exchange``).
PIDBOX_SUFFIX = ".pidbox"
#: Signal names a cancel may carry (Celery's ``revoke(signal=...)``), as Celery spells them.
SIGNALS = frozenset({"SIGTERM", "SIGKILL", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1",
                     "SIGUSR2"})


def cancel_body(wire_task_id: str, attempt_id: str, epoch: int, terminate: bool,
                signal: str | None) -> dict[str, Any]:
    """The gateway's ``task.cancel`` body for one attempt."""
    body: dict[str, Any] = {"task_id": wire_task_id, "attempt_id": attempt_id,
                            "epoch": str(epoch), "terminate": terminate}
    name = signal_name(signal)
    if terminate and name is not None:
        body["signal"] = name
    return body


def signal_name(signal: Any) -> str | None:
    """A revoke's signal as the protocol spells it (``SIGKILL``), from Celery's spellings
    (``"KILL"``, ``"SIGKILL"``, ``9``); None for the default (``SIGTERM``) or one the
    protocol doesn't carry."""
    import signal as signals

    if isinstance(signal, int) and not isinstance(signal, bool):
        try:
            signal = signals.Signals(signal).name
        except ValueError:
            return None
    if not isinstance(signal, str):
        return None
    name = signal.upper() if signal.upper().startswith("SIG") else f"SIG{signal.upper()}"
    return name if name in SIGNALS else None


def revoke_control(celery_task_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The broadcast body Celery's ``revoke`` sends, for the task a cancel names."""
    arguments: dict[str, Any] = {"task_id": celery_task_id,
                                 "terminate": bool(body.get("terminate"))}
    signal = body.get("signal")
    if isinstance(signal, str) and signal in SIGNALS:
        arguments["signal"] = signal
    return {"method": "revoke", "arguments": arguments, "destination": None}


def pidbox_message(control: Mapping[str, Any], queue: str) -> dict[str, Any]:
    """``control`` as the virtual transport's payload on ``queue`` (JSON, no reply)."""
    return {"body": base64.b64encode(json.dumps(control).encode()).decode(),
            "content-type": "application/json", "content-encoding": "utf-8",
            "headers": {},
            "properties": {"body_encoding": "base64", "delivery_tag": uuid.uuid4().hex,
                           "delivery_info": {"exchange": "celery.pidbox",
                                             "routing_key": queue}}}
