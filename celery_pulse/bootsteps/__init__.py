"""Thin Celery bootsteps: they build and stop the services that do the work."""
