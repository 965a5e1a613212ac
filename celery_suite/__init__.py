"""Run Celery's own ``t/integration`` suite against an external ``celery worker``.

The same upstream tests run once with ``-P prefork`` (the reference) and once with
``-P pulse``; a test that passes on prefork and not on pulse is a pulse regression.
See ``docs/celery-suite.md``.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_DIR = PACKAGE_DIR.parent
CACHE_DIR = PROJECT_DIR / "build" / "celery-suite"
PASSLIST_FILE = PACKAGE_DIR / "prefork_passed.txt"
#: The pass list of the ``--backend pulse`` pass (result_backend = pulse+<the run's store>).
PULSE_BACKEND_PASSLIST_FILE = PACKAGE_DIR / "prefork_passed_pulse_backend.txt"
EXCEPTIONS_FILE = PACKAGE_DIR / "exceptions.txt"

#: ``--backend``: ``redis`` (``redis://127.0.0.1:6379/9``, or CELERY_SUITE_BACKEND) or
#: ``pulse`` (``pulse+<url of the run's private PostgreSQL store>``).
BACKENDS = ("redis", "pulse")

#: Modules of t/integration the suite runs by default (measured to fit the CI budget; see
#: docs/celery-suite.md). test_redis_backend.py goes first: two of its tests assert that no
#: ``celery-task-meta-*`` pub/sub channel is open server-wide, which the result consumers of
#: the other modules' tests leave behind in the same test process.
DEFAULT_MODULES = ("test_redis_backend.py", "test_tasks.py", "test_canvas.py", "test_inspect.py",
                   "test_group_chains.py")

#: The modules of the ``--backend pulse`` pass: those whose tests read results, groups and
#: chords back through the backend. test_redis_backend.py and test_group_chains.py skip
#: every test on a backend that is not Redis; test_inspect.py tests remote control, which the
#: Redis pass already covers.
PULSE_BACKEND_MODULES = ("test_tasks.py", "test_canvas.py")


def passlist_file(backend: str) -> Path:
    """The pass list ``check --backend <backend>`` reads and ``passlist`` writes."""
    return PULSE_BACKEND_PASSLIST_FILE if backend == "pulse" else PASSLIST_FILE


def default_modules(backend: str) -> tuple[str, ...]:
    return PULSE_BACKEND_MODULES if backend == "pulse" else DEFAULT_MODULES


def celery_version() -> str:
    """The installed Celery's version: the tests must match the code they test."""
    from importlib.metadata import version

    return version("celery")


def suite_dir(version: str | None = None) -> Path:
    """Where ``fetch`` extracts the sdist's ``t/`` (and where pytest's rootdir is)."""
    return CACHE_DIR / f"celery-{version or celery_version()}"


def deps_dir(version: str | None = None) -> Path:
    """Extra packages the upstream tests import that the project does not depend on."""
    return CACHE_DIR / f"deps-{version or celery_version()}"
