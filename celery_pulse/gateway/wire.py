"""Reading a frame's JSON strictly, and the typed fields of its objects (pulse.worker.v1).

The codec's lower half, pure Python: the rules of :mod:`celery_pulse.gateway.frames` that
are about JSON itself (size before parsing, one object, no duplicate keys, no non-finite
numbers, int64 only, no lone surrogates, bounded depth) and the exact-field readers its
body readers are built from. Every refusal is a :class:`ProtocolError` whose message
names the field but never echoes a long or secret value.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from celery_pulse.gateway.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    MAX_LABEL,
    Code,
    ProtocolError,
)

# Explicit ASCII classes: ``\d`` and ``\w`` would let other scripts' digits through.
#: The form of every id (message, session, instance, task, attempt): 32 lowercase hex.
ID_FORM = re.compile(r"[0-9a-f]{32}")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: A surrogate's escape (a valid pair matches too; json joins it into one character).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
#: Names a message may repeat; anything else the peer sent is described, not echoed.
_NAMEABLE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def fail(code: str, message: str) -> NoReturn:
    raise ProtocolError(code, message)


def invalid(message: str) -> NoReturn:
    raise ProtocolError(Code.INVALID_FRAME, message)


def nameable(value: object) -> str:
    return repr(value) if isinstance(value, str) and _NAMEABLE.fullmatch(value) else "(not shown)"


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        invalid("duplicate key in a JSON object")
    return obj


def _parse_int(text: str) -> int:
    # Length first: int() of a 500,000-digit string is slow before it is refused.
    if len(text) > 20 or not INT64_MIN <= (value := int(text)) <= INT64_MAX:
        invalid("integer outside the 64-bit range")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        invalid("non-finite number")
    return value


def _parse_constant(text: str) -> NoReturn:
    invalid("non-finite number")


def _check_tree(root: dict[str, Any], strings: bool) -> None:
    """Depth, level by level without recursion; with ``strings``, lone surrogates too."""
    level: list[Any] = [root]
    depth = 1
    while level:
        if depth > MAX_DEPTH:
            invalid(f"JSON nested deeper than {MAX_DEPTH} levels")
        below: list[Any] = []
        for container in level:
            values = container.values() if isinstance(container, dict) else container
            if strings and isinstance(container, dict):
                values = [*container, *values]
            for value in values:
                if isinstance(value, dict | list):
                    below.append(value)
                elif strings and isinstance(value, str) and _SURROGATE.search(value):
                    invalid("invalid Unicode (lone surrogate)")
        level = below
        depth += 1


def load(data: str | bytes) -> dict[str, Any]:
    if not isinstance(data, str):
        invalid("binary frames are refused")
    # Every character is 1-4 bytes of UTF-8, so only the middle band needs encoding.
    if len(data) > MAX_FRAME_BYTES or (
            len(data) * 4 > MAX_FRAME_BYTES
            and len(data.encode("utf-8", "surrogatepass")) > MAX_FRAME_BYTES):
        fail(Code.FRAME_TOO_LARGE, f"frame exceeds {MAX_FRAME_BYTES} bytes")
    try:
        value = json.loads(data, object_pairs_hook=_object_pairs, parse_int=_parse_int,
                           parse_float=_parse_float, parse_constant=_parse_constant)
    except ProtocolError:
        raise
    except RecursionError:
        invalid(f"JSON nested deeper than {MAX_DEPTH} levels")
    except ValueError:
        invalid("frame is not valid JSON")
    if not isinstance(value, dict):
        invalid("frame must be a JSON object")
    # Where a decoded string can get a surrogate from: the character itself, or its escape.
    escaped = "\\u" in data and _SURROGATE_ESCAPE.search(data) is not None
    raw = not data.isascii() and _SURROGATE.search(data) is not None
    _check_tree(value, strings=escaped or raw)
    return value


def exact(obj: Any, path: str, required: frozenset[str],
          optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        invalid(f"{path} must be an object")
    if unknown := obj.keys() - required - optional:
        invalid(f"{path} has an unknown field {nameable(min(unknown))}")
    if missing := required - obj.keys():
        invalid(f"{path}.{min(missing)} is required")
    return obj


def string(obj: dict[str, Any], key: str, path: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        invalid(f"{path}.{key} must be a string")
    return value


def label(obj: dict[str, Any], key: str, path: str) -> str:
    value = string(obj, key, path)
    # Printable: a NUL or control character would reach the store (PostgreSQL text holds no NUL).
    if not (1 <= len(value) <= MAX_LABEL and value.isprintable()):
        invalid(f"{path}.{key} must be 1 to {MAX_LABEL} printable characters")
    return value


def identifier(value: Any, where: str) -> str:
    if not isinstance(value, str):
        invalid(f"{where} must be a string")
    if not ID_FORM.fullmatch(value):
        fail(Code.INVALID_ID, f"{where} must be 32 lowercase hex digits")
    return value


def decimal(obj: dict[str, Any], key: str, path: str) -> int:
    value = string(obj, key, path)
    if not _DECIMAL.fullmatch(value) or (number := int(value)) > INT64_MAX:
        invalid(f"{path}.{key} must be a decimal string of a 64-bit integer")
    return number


def integer(obj: dict[str, Any], key: str, path: str, low: int, high: int) -> int:
    value = obj[key]
    if type(value) is not int or not low <= value <= high:  # bool is an int subclass
        invalid(f"{path}.{key} must be an integer from {low} to {high}")
    return value


def boolean(obj: dict[str, Any], key: str, path: str) -> bool:
    value = obj[key]
    if not isinstance(value, bool):
        invalid(f"{path}.{key} must be a boolean")
    return value


def compact(value: Any, **options: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, **options)

