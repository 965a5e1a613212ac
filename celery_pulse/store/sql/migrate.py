"""Schema versioning with Alembic, in a version table of our own.

``pulse_alembic_version`` keeps our history apart from the user's own Alembic
history in the same database.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

VERSION_TABLE = "pulse_alembic_version"
_SCRIPTS = os.path.join(os.path.dirname(__file__), "migrations")


def alembic_config(engine: sa.Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", _SCRIPTS)
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    head = ScriptDirectory(_SCRIPTS).get_current_head()
    assert head is not None
    return head


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the store is at (None: no schema), read from our version table.

    Read with a plain query, not through Alembic's ``MigrationContext``: that logs its
    INFO lines ("Context impl ...", "Will assume ... DDL") on every call, and every
    worker start checks the schema. ``pulse migrate`` still lets Alembic say what it did.
    """
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(VERSION_TABLE):
            return None
        heads = sorted(conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")
                                    ).scalars())
    # Our history is linear: several rows would be a damaged table, never equal to head.
    return ",".join(heads) or None


def upgrade(engine: sa.Engine, revision: str = "head") -> tuple[str | None, str]:
    """Bring the schema to ``revision``; idempotent. Returns (before, after)."""
    before = current_revision(engine)
    command.upgrade(alembic_config(engine), revision)
    return before, current_revision(engine) or ""
