"""The Docker route: pytest-celery's own worker container, running ``-P pulse``.

For suites whose CI has Docker and a registry. Not used by this project's CI (no
image can be pulled there); the local nodes of this package need neither.
"""

from __future__ import annotations

import shlex
from types import ModuleType

from pytest_celery import CeleryWorkerContainer


class PulseWorkerContainer(CeleryWorkerContainer):
    """pytest-celery's worker container, with the pulse pool and a migrated store.

    The image must have ``celery-pulse-leases`` installed (set
    ``PYTEST_CELERY_PKG="pytest-celery celery-pulse-leases[postgres]"``, or build your
    own image), and the store URL in the app's config (``pulse_store_url``) must be
    reachable from inside the container: a SQLite file in the container is private to
    it, so use a PostgreSQL container or server. Wire it in as pytest-celery documents
    for any custom worker container (``default_worker_container_cls`` and
    ``default_worker_container_session_cls`` fixtures).
    """

    @classmethod
    def command(cls, *args: str, debugpy: bool = False, wait_for_client: bool = True,
                **kwargs: dict) -> list[str]:  # type: ignore[type-arg]
        worker = super().command("-P", "pulse", *args, debugpy=debugpy,
                                 wait_for_client=wait_for_client, **kwargs)
        migrate = "celery -A app pulse migrate"
        return ["sh", "-c", f"{migrate} && exec {shlex.join(worker)}"]

    @classmethod
    def app_module(cls) -> ModuleType:
        """pytest-celery's app template, with ``celery_pulse.install(app)`` added."""
        from celery_pulse.contrib.pytest_celery import docker_app

        return docker_app
