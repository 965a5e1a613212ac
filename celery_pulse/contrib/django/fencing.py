"""``lease.fenced(django.db.connection)``: a Django task's ORM writes commit only while
its attempt holds the lease.

The same fence as for a SQLAlchemy connection (:mod:`celery_pulse.store.sql.fence`),
on Django's own connection and transaction: ``transaction.atomic()`` opens it, a no-op
UPDATE locks this task's claim row if the attempt holds its lease by the store clock
(no takeover can be granted while it is locked), the block runs, the lease is checked
again before commit. Lost at either check, the block's writes roll back and
``LeaseLost`` is raised. The transaction's waits are capped at the lease TTL as there
(PostgreSQL's ``SET LOCAL``; MySQL/MariaDB's session caps, put back before commit), so
a holder paused inside the block loses its transaction instead of pinning the row.

Only on the pulse store's own database (``pulse_database``, or a ``pulse_store_url``
naming the same database): anywhere else the claim row isn't there to lock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery_pulse.contrib.django.database import url_of
from celery_pulse.errors import InvalidConfig
from celery_pulse.lease import Lease
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.fence import guard_statement, held_statement, mysql_caps, postgres_caps

#: Django's vendors as the store's dialects.
DIALECTS = {"postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


class DjangoFence:
    """The fence kind of Django's database connections (registered by the app)."""

    def accepts(self, target: Any) -> bool:
        return _wrapper(target) is not None

    @contextmanager
    def fenced(self, lease: Lease, target: Any, ttl: float,
               same_store: Callable[[str], bool]) -> Iterator[Any]:
        from django.db import transaction

        target = _wrapper(target)
        dialect = self._dialect(target)
        if not same_store(url_of(target.alias, target.settings_dict)):
            raise InvalidConfig(
                f"lease.fenced(): Django's database {target.alias!r} is not the pulse store's; "
                f"set pulse_database = {target.alias!r} (or for another resource use "
                f"lease.check() and the (task_id, epoch) token)")
        self._not_in_transaction(target)
        lease.check()
        with transaction.atomic(using=target.alias):
            saved = self._cap(target, dialect, ttl)
            try:
                if not self._fetch(target, guard_statement(lease, dialect), dialect.is_mysql):
                    raise lease.lost_error(" (the store refused the fenced write)")
                yield target
                lease.check()
                if not self._fetch(target, held_statement(lease, dialect), False):
                    raise lease.lost_error(" (expired before commit)")
            finally:
                self._restore(target, saved)

    @contextmanager
    def plain(self, target: Any) -> Iterator[Any]:
        from django.db import transaction

        target = _wrapper(target)
        # Nested in the caller's atomic() (Django's TestCase wraps every test in one) it
        # is a savepoint: nothing is fenced in-process anyway.
        with transaction.atomic(using=target.alias):
            yield target

    @staticmethod
    def _not_in_transaction(target: Any) -> None:
        if target.in_atomic_block:
            raise InvalidConfig(
                f"lease.fenced(): Django's connection {target.alias!r} is already in a "
                f"transaction (transaction.atomic or ATOMIC_REQUESTS); the fenced block "
                f"must be the transaction: open it outside any other")

    @staticmethod
    def _dialect(target: Any) -> Dialect:
        name = DIALECTS.get(target.vendor)
        if name is None:
            raise InvalidConfig(f"lease.fenced(): Django's {target.vendor!r} database can't be "
                                f"the pulse store")
        return Dialect(name)

    @staticmethod
    def _fetch(target: Any, statement: Any, counted: bool) -> bool:
        """Run a store statement on Django's cursor: whether it matched a row."""
        sql, params = _compiled(statement, target.vendor)
        with target.cursor() as cursor:
            cursor.execute(sql, params)
            return bool(cursor.rowcount) if counted else cursor.fetchone() is not None

    @staticmethod
    def _cap(target: Any, dialect: Dialect, ttl: float) -> dict[str, Any]:
        with target.cursor() as cursor:
            if dialect.is_postgres:
                for statement in postgres_caps(ttl):
                    cursor.execute(statement)
            if not dialect.is_mysql:
                return {}
            caps = mysql_caps(ttl, bool(getattr(target, "mysql_is_mariadb", False)))
            cursor.execute("SELECT " + ", ".join(f"@@SESSION.{name}" for name in caps))
            saved = dict(zip(caps, cursor.fetchone(), strict=True))
            cursor.execute("SET " + ", ".join(f"SESSION {k} = {v}" for k, v in caps.items()))
            return saved

    @staticmethod
    def _restore(target: Any, saved: dict[str, Any]) -> None:
        if not saved or target.connection is None:
            return
        from django.db import DatabaseError

        try:
            with target.cursor() as cursor:
                cursor.execute("SET " + ", ".join(f"SESSION {k} = {v}"
                                                  for k, v in saved.items()))
        except DatabaseError:  # a connection the server closed is discarded anyway
            pass


def _wrapper(target: Any) -> Any:
    """Django's connection behind ``target`` (``django.db.connection`` is a proxy of the
    default one; ``connections["alias"]`` is one already), or None: not Django's."""
    if "django.db" not in sys.modules:
        return None
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(target, ConnectionProxy):
        return connections[target._alias]
    return target if isinstance(target, BaseDatabaseWrapper) else None


def _compiled(statement: Any, vendor: str) -> tuple[str, list[Any]]:
    """A store statement as SQL for Django's cursor (``%s`` placeholders, which Django
    takes on every backend) and its parameters in order."""
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    dialect = {"postgresql": postgresql.psycopg.dialect, "mysql": mysql.pymysql.dialect,
               "sqlite": sqlite.pysqlite.dialect}[vendor](paramstyle="format")
    compiled = statement.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
    return str(compiled), [compiled.params[name] for name in compiled.positiontup or ()]
