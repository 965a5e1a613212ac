"""The project package: its Celery app is loaded with Django, as Celery's guide does."""

from example_django.shop.celery import app as celery_app

__all__ = ["celery_app"]
