"""Cluster-wide limits as declared: concurrency limits (an integer) and rate limits
(Celery's own syntax, ``"100/m"``), checked once, naming the setting or task option.

A rate is kept exact, as a count and a window (``"100/m"`` is 100 starts in any 60 s),
never as Celery's per-second float: the store counts starts over the window.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from celery_pulse.errors import InvalidConfig

#: Celery's rate units (``celery.utils.time.rate``): per second, minute, hour.
RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
#: No rate's window is longer (what retention keeps of past starts).
LONGEST_WINDOW = max(RATE_UNITS.values())
#: The permit keys' grammar, one for workers and gateways: ``task:NAME[PARTITION]``,
#: ``queue:NAME``, and a rate's the same behind ``rate:``.
TASK_PREFIX, QUEUE_PREFIX, RATE_PREFIX = "task:", "queue:", "rate:"
_RATE = re.compile(r"\s*(\d+)\s*(?:/\s*([smh]))?\s*")


def concurrency_limit(key: str, value: Any, setting: str) -> int:
    """A concurrency limit as declared: an integer >= 1 (``key`` names the declaration,
    ``setting`` the setting or task option it belongs to)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfig(f"{key}: a concurrency limit must be an integer >= 1, got "
                            f"{value!r}", setting=setting)
    return value


def rate_limit(key: str, value: Any, setting: str) -> tuple[int, float]:
    """A rate limit as declared, ``(count, window seconds)``: ``"N/s"``, ``"N/m"``,
    ``"N/h"`` or ``"N"`` (per second, as Celery reads it), N >= 1; a pair already read
    is kept."""
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int)
            and value[0] >= 1 and value[1] in RATE_UNITS.values()):
        return value[0], float(value[1])
    found = _RATE.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        found = _RATE.fullmatch(str(value))
    if found is None or int(found.group(1)) < 1:
        raise InvalidConfig(f"{key}: a rate limit is Celery's 'N/s', 'N/m' or 'N/h' with "
                            f"N >= 1, got {value!r}", setting=setting)
    return int(found.group(1)), RATE_UNITS[found.group(2) or "s"]


def _named(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidConfig(f"{key}: expected a dict of task names or 'queue:<name>' to "
                            f"limits, got {value!r}", setting=key)
    for name in value:
        if not isinstance(name, str) or not name.strip() or name.strip() == "queue:":
            raise InvalidConfig(f"{key}: {name!r} is neither a task name nor 'queue:<name>'",
                                setting=key)
    return {name.strip(): limit for name, limit in value.items()}


def concurrency_limits(key: str, value: Any) -> dict[str, int]:
    """``pulse_concurrency_limits``: task names and ``queue:<name>`` to limits."""
    return {name: concurrency_limit(f"{key}[{name!r}]", limit, key)
            for name, limit in _named(key, value).items()}


def rate_limits(key: str, value: Any) -> dict[str, tuple[int, float]]:
    """``pulse_rate_limits``: task names and ``queue:<name>`` to rates."""
    return {name: rate_limit(f"{key}[{name!r}]", rate, key)
            for name, rate in _named(key, value).items()}
