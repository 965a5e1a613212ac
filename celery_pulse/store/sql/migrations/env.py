"""Alembic environment: runs on the connection handed in by ``migrate.upgrade``.

That connection holds the migration lock; ``migrate.upgrade`` commits it.
"""

from __future__ import annotations

from alembic import context

from celery_pulse.store.sql.migrate import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, version_table=VERSION_TABLE,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
