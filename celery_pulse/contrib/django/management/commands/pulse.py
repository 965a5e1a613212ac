"""``manage.py pulse …``: the ``celery pulse`` commands (status, claims, review, workers,
drain, migrate, …) on this project's Celery app, without ``-A``.

The app is the one the project package loads (Celery's Django guide has
``proj/__init__.py`` import it), so the store is the app's: ``pulse_database`` included.
Everything after ``pulse`` goes to the command as ``celery -A proj pulse`` takes it:
``manage.py pulse claims --state running``, ``manage.py pulse review retry TASK_ID``.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = ("celery-pulse's commands on this project's Celery app, as `celery -A proj "
            "pulse ...` (status, workers, claims, attempts, review, drain, undrain, migrate)")

    def run_from_argv(self, argv: list[str]) -> None:
        """Django's own parser is skipped: click parses the command, exits with its code,
        and prints its own help (``manage.py pulse --help``)."""
        from celery import current_app
        from celery.bin.base import CLIContext

        from celery_pulse.cli import pulse

        app = current_app._get_current_object()
        pulse.main(args=argv[2:], prog_name=f"{argv[0]} {argv[1]}",
                   obj=CLIContext(app=app, no_color=False, workdir=None, quiet=False))

    def handle(self, *args: Any, **options: Any) -> None:  # pragma: no cover
        """Only :meth:`run_from_argv` runs (``call_command`` is not supported)."""
        raise NotImplementedError("run it as manage.py pulse ...")
