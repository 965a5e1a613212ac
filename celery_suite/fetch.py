"""``fetch``: the installed Celery's sdist from PyPI, its ``t/`` tree, and what the tests import.

Wheels don't ship ``t/``, so the sdist is the only source of the tests that match
the installed code. Everything lands under ``build/celery-suite/`` and a second call
does nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from celery_suite import CACHE_DIR, celery_version, deps_dir, suite_dir

#: pytest settings for the extracted tree: Celery's own (its test classes are
#: lower-case ``test_*``, xfail is strict) plus the markers its integration tests use.
PYTEST_INI = """\
# Written by `python -m celery_suite fetch`: Celery's pytest settings for t/integration.
[pytest]
python_classes = test_*
xfail_strict = true
timeout_method = signal
markers =
    flaky: pytest-rerunfailures marker (not installed: no reruns)
    celery: override celery configuration for a test case
    amqp: needs an AMQP broker
    sleepdeprived_patched_module
    masked_modules
    patched_environ
    patched_module
"""

#: What the integration tests import beyond Celery and the project's dev extras.
EXTRA_REQUIREMENTS = ("requirements/extras/pydantic.txt",)


def _log(msg: str) -> None:
    print(f"celery-suite fetch: {msg}", flush=True)


def _download_sdist(version: str) -> Path:
    """``pip download`` the sdist (never a wheel: wheels have no tests)."""
    sdist_dir = CACHE_DIR / "sdist"
    sdist = sdist_dir / f"celery-{version}.tar.gz"
    if sdist.exists():
        return sdist
    sdist_dir.mkdir(parents=True, exist_ok=True)
    _log(f"downloading the celery {version} sdist")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", "-d", str(sdist_dir), f"celery=={version}"],
        check=True, stdin=subprocess.DEVNULL,
    )
    if not sdist.exists():
        raise SystemExit(f"pip download did not produce {sdist}")
    return sdist


def _wanted(rel: str) -> bool:
    """t/__init__.py, the helpers in t/, all of t/integration and the requirement pins.

    Not t/unit, t/smoke or t/benchmarks: they are not run here.
    """
    if rel.startswith(("t/integration/", "requirements/")):
        return True
    return rel.startswith("t/") and rel.count("/") == 1


def _extract(sdist: Path, version: str, target: Path) -> None:
    """Extract into a temp dir and rename, so a half-done extraction is never used."""
    prefix = f"celery-{version}/"
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            rel = member.name[len(prefix):] if member.name.startswith(prefix) else ""
            if not rel or not _wanted(rel) or not member.isfile():  # parent dirs come along
                continue
            member.name = member.name[len(prefix):]
            members.append(member)
        data_filter = getattr(tarfile, "data_filter", None)
        if data_filter is not None:
            tar.extractall(tmp, members=members, filter=data_filter)
        else:  # Python < 3.10.12: the names were checked above
            tar.extractall(tmp, members=members)
    if not (tmp / "t" / "integration" / "conftest.py").exists():
        raise SystemExit(f"{sdist.name} has no t/integration/conftest.py")
    (tmp / "pytest.ini").write_text(PYTEST_INI)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _pins(target: Path) -> list[str]:
    reqs: list[str] = []
    for rel in EXTRA_REQUIREMENTS:
        path = target / rel
        if path.exists():
            reqs += [line.strip() for line in path.read_text().splitlines()
                     if line.strip() and not line.startswith(("#", "-"))]
    return reqs


def _install_deps(target: Path, deps: Path) -> None:
    """Install the tests' extra imports (pydantic) into a private dir, not the venv.

    The venv's own packages are passed as constraints, so anything pip puts beside
    them in ``deps`` (typing_extensions, ...) is the same version as the venv's.
    """
    stamp = deps / ".complete"
    reqs = _pins(target)
    if stamp.exists() and stamp.read_text() == "\n".join(reqs):
        return
    shutil.rmtree(deps, ignore_errors=True)
    deps.mkdir(parents=True)
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
        check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL,
    ).stdout
    constraints = deps / "constraints.txt"
    constraints.write_text("\n".join(line for line in freeze.splitlines()
                                     if re.match(r"^[A-Za-z0-9_.-]+==", line)) + "\n")
    if reqs:
        _log(f"installing {', '.join(reqs)} into {deps}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--only-binary", ":all:", "--target", str(deps), "-c", str(constraints), *reqs],
            check=True, stdin=subprocess.DEVNULL,
        )
    stamp.write_text("\n".join(reqs))


def fetch(version: str | None = None) -> Path:
    """Make ``build/celery-suite/celery-<version>/t/integration`` ready to run. Idempotent."""
    version = version or celery_version()
    target = suite_dir(version)
    if not (target / "pytest.ini").exists():
        sdist = _download_sdist(version)
        _log(f"extracting t/ from {sdist.name} into {target}")
        _extract(sdist, version, target)
    _install_deps(target, deps_dir(version))
    return target
