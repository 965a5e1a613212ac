"""Schema versioning with Alembic, in a version table of our own.

``pulse_alembic_version`` keeps our history apart from the user's own Alembic
history in the same database. ``pulse_schema_compat`` records, per applied revision,
the oldest code revision that can run on it (each migration's ``OLDEST_CODE``): code
that does not know a newer revision still reads there whether it may run on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from celery_pulse.errors import SchemaTooNew, StoreUnavailable

VERSION_TABLE = "pulse_alembic_version"
COMPAT_TABLE = "pulse_schema_compat"
_SCRIPTS = os.path.join(os.path.dirname(__file__), "migrations")
#: MariaDB's GET_LOCK waits at most this long for another ``pulse migrate``.
_LOCK_WAIT = 600
#: PostgreSQL: the migration's own cap on idle time inside its transaction. The engine
#: caps every transaction at a couple of seconds (a paused worker must not keep its row
#: locks); a migration runs Alembic's Python between its statements (each revision file
#: is read and run), which a loaded machine can stretch past that cap, and the server
#: then ended the migration midway ("idle-in-transaction timeout"). Still capped: a
#: paused migration must not hold the schema's lock forever.
_MIGRATION_IDLE_MS = 300_000

_compat = sa.Table(COMPAT_TABLE, sa.MetaData(),
                   sa.Column("revision", sa.String(32), primary_key=True),
                   sa.Column("oldest_code", sa.String(32), nullable=False))


def alembic_config(connection: sa.Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", _SCRIPTS)
    cfg.attributes["connection"] = connection
    return cfg


def _scripts() -> ScriptDirectory:
    return ScriptDirectory(_SCRIPTS)


def head_revision() -> str:
    head = _scripts().get_current_head()
    assert head is not None
    return head


def known_revisions() -> set[str]:
    """Every revision this code has a migration for."""
    return {script.revision for script in _scripts().walk_revisions()}


def _read_current(conn: sa.Connection) -> str | None:
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    heads = sorted(conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
    # Our history is linear: several rows would be a damaged table, never equal to head.
    return ",".join(heads) or None


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the store is at (None: no schema), read from our version table.

    Read with a plain query, not through Alembic's ``MigrationContext``: that logs its
    INFO lines ("Context impl ...", "Will assume ... DDL") on every call, and every
    worker start checks the schema. ``pulse migrate`` still lets Alembic say what it did.
    """
    with engine.connect() as conn:
        return _read_current(conn)


def oldest_code(engine: sa.Engine, revision: str) -> str | None:
    """The oldest code revision the schema at ``revision`` declared it runs (None: unknown)."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(COMPAT_TABLE):
            return None
        row = conn.execute(sa.select(_compat.c.oldest_code)
                           .where(_compat.c.revision == revision)).scalar_one_or_none()
    return None if row is None else str(row)


def is_newer(revision: str, than: str) -> bool:
    """Revisions are numbered in order ("0012"): compare them as numbers."""
    try:
        return int(revision) > int(than)
    except ValueError:  # not ours to order: treat as incompatible
        return True


def too_new(url: str, current: str, head: str, oldest: str | None) -> SchemaTooNew:
    need = f"code at revision {oldest} or later" if oldest else "newer code"
    return SchemaTooNew(
        f"the pulse schema in {url} is at revision {current}, newer than this celery-pulse "
        f"(revision {head}), and needs {need}: upgrade celery-pulse to a release that "
        f"knows revision {current} (do not migrate the schema back)")


@contextmanager
def _serialised(conn: sa.Connection) -> Iterator[None]:
    """One ``pulse migrate`` at a time per schema: the others wait, then find it at head.

    PostgreSQL: a transaction-level advisory lock, released by the migration's commit.
    MariaDB: GET_LOCK (DDL commits implicitly, so a session lock). SQLite: the database
    file's own write lock serialises writers.
    """
    name = conn.dialect.name
    if name == "postgresql":
        conn.execute(sa.text("SELECT set_config('idle_in_transaction_session_timeout', "
                             ":ms, true)"), {"ms": str(_MIGRATION_IDLE_MS)})
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext("
                             "'celery_pulse.migrate:' || coalesce(current_schema(), '')))"))
        yield
    elif name in ("mysql", "mariadb"):
        key = "CONCAT('celery_pulse.migrate:', IFNULL(DATABASE(), ''))"
        got = conn.execute(sa.text(f"SELECT GET_LOCK({key}, {_LOCK_WAIT})")).scalar()
        conn.commit()  # read the schema afresh, not from a snapshot taken before the wait
        if got != 1:
            raise StoreUnavailable(f"another `pulse migrate` held its lock over {_LOCK_WAIT} s")
        try:
            yield
        finally:
            conn.execute(sa.text(f"SELECT RELEASE_LOCK({key})"))
            conn.commit()
    else:
        yield


def _record_compat(conn: sa.Connection) -> None:
    """Write each known revision's ``OLDEST_CODE`` (idempotent)."""
    _compat.create(conn, checkfirst=True)
    rows = {s.revision: getattr(s.module, "OLDEST_CODE", s.revision)
            for s in _scripts().walk_revisions()}
    conn.execute(_compat.delete().where(_compat.c.revision.in_(list(rows))))
    conn.execute(_compat.insert(), [{"revision": r, "oldest_code": o} for r, o in rows.items()])


def upgrade(engine: sa.Engine, url: str = "") -> tuple[str | None, str]:
    """Bring the schema to head; idempotent and serialised. Returns (before, after).

    Refuses (:class:`SchemaTooNew`) a schema at a revision this code has no migration
    for: Alembic would fail with a traceback ("Can't locate revision").
    """
    head = head_revision()
    with engine.connect() as conn, _serialised(conn):
        before = _read_current(conn)
        if before is not None and before not in known_revisions():
            raise too_new(url or str(engine.url), before, head, None)
        command.upgrade(alembic_config(conn), "head")
        _record_compat(conn)
        conn.commit()
        return before, _read_current(conn) or ""
