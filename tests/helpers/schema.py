"""The published JSON Schema of pulse.worker.v1 (``celery_pulse/gateway/schema/``), read
as the package ships it, and a validator for each direction of a connection.

For the tests that keep the schema and the codec in agreement (tests/unit/) and that
check what a real gateway session sends and receives (tests/acceptance/).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator

SCHEMA_FILE = "pulse.worker.v1.schema.json"


def schema_text() -> str:
    """The schema file's text, from the installed package's data."""
    return (resources.files("celery_pulse.gateway") / "schema" / SCHEMA_FILE).read_text("utf-8")


SCHEMA: dict[str, Any] = json.loads(schema_text())
DEFS: dict[str, Any] = SCHEMA["$defs"]


def _validator(definition: str) -> Draft202012Validator:
    return Draft202012Validator({**SCHEMA, "oneOf": [{"$ref": f"#/$defs/{definition}"}]})


CLIENT = _validator("client_frame")
SERVER = _validator("server_frame")
ANY = Draft202012Validator(SCHEMA)


def client_valid(frame: Any) -> bool:
    return bool(CLIENT.is_valid(frame))


def server_valid(frame: Any) -> bool:
    return bool(SERVER.is_valid(frame))


def assert_client(frame: Any) -> None:
    """Raise (with the schema's reasons) unless ``frame`` is a valid worker frame."""
    _assert(CLIENT, frame)


def assert_server(frame: Any) -> None:
    """Raise (with the schema's reasons) unless ``frame`` is a valid gateway frame."""
    _assert(SERVER, frame)


def _assert(validator: Draft202012Validator, frame: Any) -> None:
    errors = sorted(validator.iter_errors(frame), key=lambda e: list(e.absolute_path))
    if errors:
        reasons = "; ".join(
            f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
            + "".join(f" [{c.message[:200]}]" for c in (e.context or [])[:6])
            for e in errors)
        raise AssertionError(f"not valid by the schema: {reasons}\n{json.dumps(frame)[:2000]}")


def properties(definition: str) -> set[str]:
    """The property names a definition allows (its own and those of the one it refers to)."""
    schema = DEFS[definition]
    names = set(schema.get("properties", {}))
    ref = schema.get("$ref")
    if ref is not None:
        names |= properties(ref.rsplit("/", 1)[1])
    return names


def required(definition: str) -> set[str]:
    schema = DEFS[definition]
    names = set(schema.get("required", []))
    ref = schema.get("$ref")
    if ref is not None:
        names |= required(ref.rsplit("/", 1)[1])
    return names


def frame_definitions(direction: str) -> dict[str, str]:
    """``{type: definition}`` of ``client_frame`` or ``server_frame``."""
    out = {}
    for choice in DEFS[f"{direction}_frame"]["oneOf"]:
        name = choice["$ref"].rsplit("/", 1)[1]
        out[DEFS[name]["properties"]["type"]["const"]] = name
    return out
