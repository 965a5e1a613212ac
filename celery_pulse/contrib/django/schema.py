"""pulse's schema from ``manage.py migrate``: Django's migration runs pulse's own (Alembic)
on the store, so ``manage.py migrate`` and ``celery pulse migrate`` make one schema.

It runs only on the database that is the pulse store (the Celery app's
``pulse_database``, or a ``pulse_store_url`` naming the same database): a ``migrate`` of
another alias leaves it alone. Every later pulse release that changes the schema ships
a Django migration that runs this again (Alembic does what is missing; a second run
does nothing).
"""

from __future__ import annotations

import logging
from typing import Any

from celery_pulse.errors import InvalidConfig, PulseError

logger = logging.getLogger(__name__)


def upgrade(apps: Any, schema_editor: Any) -> None:
    """Bring the pulse store to the code's schema, if this migration's database is it."""
    from celery import current_app

    from celery_pulse.contrib.django.database import url_of
    from celery_pulse.deferral import same_store
    from celery_pulse.settings import Settings
    from celery_pulse.store.sql import open_store

    connection = schema_editor.connection
    try:
        settings = Settings.from_conf(current_app.conf)
        here = url_of(connection.alias, connection.settings_dict)
    except InvalidConfig as exc:  # e.g. Django's in-memory SQLite test database
        logger.warning("pulse: no pulse schema in %r: %s", connection.alias, exc)
        return
    if not same_store(settings.store_url, here):
        logger.info("pulse: %r is not the pulse store's database: its schema is left to "
                    "`celery pulse migrate`", connection.alias)
        return
    store = open_store(settings.store_url, check_schema=False)
    try:
        before, after = store.migrate()
    finally:
        store.close()
    logger.info("pulse: schema in %s: %s -> %s", store.url, before or "empty", after)


def downgrade_refused(apps: Any, schema_editor: Any) -> None:
    """pulse's tables hold live claims: they are never dropped by a migration."""
    raise PulseError("pulse's schema is not rolled back by manage.py migrate: drop its "
                     "tables by hand if you mean to (docs/django.md)")
