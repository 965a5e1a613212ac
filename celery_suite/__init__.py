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
EXCEPTIONS_FILE = PACKAGE_DIR / "exceptions.txt"

#: Modules of t/integration the suite runs by default (measured to fit the CI budget; see
#: docs/celery-suite.md). test_redis_backend.py goes first: two of its tests assert that no
#: ``celery-task-meta-*`` pub/sub channel is open server-wide, which the result consumers of
#: the other modules' tests leave behind in the same test process.
DEFAULT_MODULES = ("test_redis_backend.py", "test_tasks.py", "test_canvas.py", "test_inspect.py",
                   "test_group_chains.py")


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
