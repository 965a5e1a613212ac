"""A Django project on celery-pulse (docs/django.md): the store is Django's own database,
and a task's ORM writes commit only while it holds its lease."""
