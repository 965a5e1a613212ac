"""What a delivery must be before the store sees it, and how one that isn't is settled.

A broker carries whatever anyone published. A message Celery cannot run, or the claim
row cannot hold, must neither reach the store (a driver error there would look like an
outage and stall every later delivery) nor the worker's event loop (an exception there
ends the worker, and a restarted one meets the same message). Such a delivery is settled
as Celery settles an invalid task message, rejected without requeue (RabbitMQ
dead-letters it where the queue has a dead-letter exchange; Redis drops it), in one log
line that names its id, its queue and why, and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery_pulse.errors import PulseError
from celery_pulse.messages import FIXED_PUBLICATION_HEADER, PUBLICATION_HEADER

logger = logging.getLogger("celery_pulse.bootsteps.intake")

#: What the claims table keeps of a task id and a task name (``String(255)``).
MAX_ID = 255
MAX_NAME = 255
#: Header values pulse stores in columns of their own, or that Celery converts.
_NUMBER = (int, float)


def name_problem(name: Any) -> str | None:
    """Why the claims table cannot keep a task's registered name (None: it can)."""
    return _text_problem("task name", name, MAX_NAME)


def _text_problem(what: str, value: Any, limit: int) -> str | None:
    if not isinstance(value, str):
        return f"{what} is of type {type(value).__name__}, not a string"
    if not value:
        return f"{what} is empty"
    if len(value) > limit:
        return f"{what} has {len(value)} characters (the store keeps {limit})"
    if "\x00" in value:
        return f"{what} contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{what} is not valid Unicode"
    return None


def _limit_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return f"timelimit is {value!r:.40}, not a [soft, hard] pair"
    for part in value:
        if part is not None and (isinstance(part, bool) or not isinstance(part, _NUMBER)
                                 or part < 0):
            return f"timelimit {value!r:.40} holds {part!r:.20}, not a number of seconds"
    return None


def _time_problem(key: str, value: Any) -> str | None:
    if value is None:
        return None
    from celery.utils.time import maybe_iso8601

    try:
        maybe_iso8601(value)
    except (AttributeError, ValueError, TypeError, OverflowError):
        return f"{key} is {value!r:.40}, not an ISO 8601 time"
    return None


def problem(headers: Any, body_size: int, max_bytes: int | None) -> str | None:
    """Why a protocol-2 task message can't be reserved (None: it can).

    Checks what the claim row needs (id type, length and characters), the headers pulse
    or Celery converts (``retries``, ``timelimit``, ``eta``, ``expires``), and the
    message's size against what the store takes in one row.
    """
    if not isinstance(headers, Mapping):
        return "its headers are not a mapping"
    if headers.get("id") is None:
        return "it has no task id"
    found = _text_problem("task id", headers["id"], MAX_ID)
    if found:
        return found
    retries = headers.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)):
        return f"retries is {retries!r:.40}, not an integer"
    for key in (PUBLICATION_HEADER, FIXED_PUBLICATION_HEADER):
        value = headers.get(key)
        if value is not None and "\x00" in str(value):
            return f"{key} contains a NUL character"
    found = _limit_problem(headers.get("timelimit")) or _time_problem(
        "eta", headers.get("eta")) or _time_problem("expires", headers.get("expires"))
    if found:
        return found
    if max_bytes is not None and body_size > max_bytes:
        return f"its body has {body_size:,} bytes (the store takes {max_bytes:,} in one claim)"
    return None


def body_size(message: Any) -> int:
    body = message.body
    return len(body) if isinstance(body, (bytes, bytearray, str)) else 0


class BodyLimit:
    """The largest body the store keeps in one claim, asked once it answers (a store
    that asks its server remembers the answer); None while it can't be asked."""

    def __init__(self, ask: Callable[[], int | None]) -> None:
        self.ask = ask
        self._known: tuple[int | None] | None = None

    def __call__(self) -> int | None:
        if self._known is None:
            try:
                self._known = (self.ask(),)
            except PulseError as exc:  # asked again with the next delivery
                logger.debug("pulse: could not ask the store its message limit: %s", exc)
                return None
        return self._known[0]


def shown_id(headers: Any) -> str:
    """The delivery's task id as a log line shows it (truncated, never raising)."""
    value = headers.get("id") if isinstance(headers, Mapping) else None
    return repr(value)[:80]


def reject(message: Any, task_name: str, why: str) -> bool:
    """Settle a delivery nobody will run: reject without requeue, in one log line.

    Whether the broker took the rejection (False: the channel is gone, and the broker
    hands the message to a consumer again, which meets the same check).
    """
    info = getattr(message, "delivery_info", None) or {}
    queue = info.get("routing_key") or info.get("exchange") or "?"
    headers = getattr(message, "headers", None)
    try:
        message.reject(requeue=False)
        settled = True
    except Exception as exc:  # the channel is gone: the broker delivers it again
        logger.debug("pulse: could not reject a malformed delivery: %r", exc)
        settled = False
    logger.error("pulse: rejected task %s[%s] from queue %s, not run: %s",
                 str(task_name)[:80], shown_id(headers), queue, why)
    return settled
