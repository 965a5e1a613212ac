"""pulse's schema by ``manage.py migrate``: Alembic's migrations, the one source of truth
(:mod:`celery_pulse.contrib.django.schema`), never a second copy of the tables."""

from django.db import migrations

from celery_pulse.contrib.django.schema import downgrade_refused, upgrade


class Migration(migrations.Migration):
    # pulse migrates through connections of its own: Django's migration transaction would
    # hold SQLite's write lock against them.
    atomic = False
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(upgrade, downgrade_refused, elidable=False)]
