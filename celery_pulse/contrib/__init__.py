"""Integrations with other tools of the Celery ecosystem (opt-in, imported by name)."""
