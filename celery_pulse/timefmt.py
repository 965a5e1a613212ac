"""How pulse shows a moment to people: ISO 8601 in UTC, never a raw epoch float.

The store keeps times as seconds since the epoch (its clock); logs and the CLI print
them with :func:`iso`, so a line can be read, and compared across machines, as is.
"""

from __future__ import annotations

from datetime import datetime, timezone


def iso(seconds: float | None, *, ms: bool = False) -> str:
    """``seconds`` since the epoch as ``2026-12-02T20:31:20Z`` (``ms``: ``...20.123Z``);
    ``-`` for None."""
    if seconds is None:
        return "-"
    moment = datetime.fromtimestamp(float(seconds), timezone.utc)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if ms:
        text += f".{moment.microsecond // 1000:03d}"
    return text + "Z"
