"""The Django app: ``INSTALLED_APPS += ["celery_pulse.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class PulseConfig(AppConfig):
    """Registers the fence of Django's connections (``lease.fenced(connection)``)."""

    name = "celery_pulse.contrib.django"
    label = "celery_pulse"
    verbose_name = "celery-pulse"

    def ready(self) -> None:
        from celery_pulse.contrib.django.fencing import DjangoFence
        from celery_pulse.lease import register_fence_kind

        register_fence_kind(DjangoFence())
