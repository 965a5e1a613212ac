"""celery-pulse for Django projects (docs/django.md).

* ``pulse_database = "default"`` (Django: ``CELERY_PULSE_DATABASE``): the store is a
  database of ``DATABASES`` (:mod:`.database`).
* ``lease.fenced(django.db.connection)``: ORM writes that commit only while the task's
  attempt holds its lease (:mod:`.fencing`), with this app in ``INSTALLED_APPS``.
"""
