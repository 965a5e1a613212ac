"""What the WebSocket library logs about a gateway connection, with its secrets cut out.

At ``DEBUG``, websockets logs every handshake header (``Authorization: Bearer <token>``
among them) and the start and end of every frame (where ``instance_secret`` and
``lease_secret`` travel). Both ends of a connection give the library one of the loggers
below instead of its own, and their filter rewrites a record before any handler sees
it: a credential is a credential at every level, and a log is read by more people than
the credential's owner. (A filter on a logger applies only to records logged on that
logger itself, hence loggers of our own rather than a filter on ``websockets``.)
"""

from __future__ import annotations

import logging
import re

from websockets.frames import Frame, Opcode

#: A bearer credential, a gateway token anywhere, a secret field of a frame.
SECRET = re.compile(r"(?i)(bearer\s+)\S+"
                    r"|(pgw1_)[A-Za-z0-9_-]+"
                    r"|(\"(?:instance_secret|lease_secret)\"\s*:\s*\")[^\"]*")
REDACTED = "[redacted]"


def _cut(match: re.Match[str]) -> str:
    kept = match.group(1) or match.group(2) or match.group(3) or ""
    return kept + REDACTED


def redact(text: str) -> str:
    """``text`` with every secret it shows replaced by ``[redacted]``."""
    return SECRET.sub(_cut, text)


class Redact(logging.Filter):
    """Rewrites a record that shows a secret; a data frame is logged by its kind and
    size only (the library shows its head and tail, which may hold part of a secret
    whose field name was cut off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, Frame) for a in args):
            record.args = tuple(_frame(a) if isinstance(a, Frame) else a for a in args)
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # a malformed record: shown as the library made it
            return True
        clean = redact(text)
        if clean != text:
            record.msg, record.args = clean, None
        return True


def _frame(frame: Frame) -> str:
    if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
        return f"{frame.opcode.name} [{len(frame.data)} bytes]"
    return str(frame)


def wire_logger(side: str) -> logging.Logger:
    """The logger to give websockets for one side (``client`` or ``server``)."""
    logger = logging.getLogger(f"celery_pulse.gateway.websockets.{side}")
    if not any(isinstance(f, Redact) for f in logger.filters):
        logger.addFilter(Redact())
    return logger
