"""Alembic environment: runs online against the engine handed in by ``migrate.upgrade``."""

from __future__ import annotations

from alembic import context

from celery_pulse.store.sql.migrate import VERSION_TABLE

engine = context.config.attributes["engine"]
with engine.connect() as connection:
    context.configure(connection=connection, version_table=VERSION_TABLE,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
