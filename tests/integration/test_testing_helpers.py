"""``celery_pulse.testing``: the worked examples of docs/testing.md, run as a user would.

Each example is a pytest file in the docs (a ```python block after a
``<!-- doc-test: pytest NAME -->`` comment; ``doc-test: file NAME`` blocks are helper
files such as a ``conftest.py``). They are written to a temporary folder and run by
pytest in a fresh process of their own: the in-process worker forks its pool from
the test process and sets up logging for it, which must not leak into this session.
Everything runs on the embedded store and broker, so no service is needed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTING_DOC = ROOT / "docs" / "testing.md"
BLOCK = re.compile(r"<!-- doc-test: (?P<kind>pytest|file) (?P<name>[\w./-]+) -->\n"
                   r"```python\n(?P<code>.*?)```", re.S)
#: Generous: each example starts (~1 s) and stops (~5 s) a worker and waits for leases.
TIMEOUT = 240.0


def doc_files(doc: Path, folder: str = "") -> dict[str, tuple[str, str]]:
    """``name -> (kind, code)`` for the doc-test blocks of ``doc`` in ``folder`` (a name prefix)."""
    found = {}
    for m in BLOCK.finditer(doc.read_text()):
        head, _, name = m["name"].rpartition("/")
        if head == folder:
            found[name] = (m["kind"], m["code"])
    return found


def run_bounded(argv: list[str], cwd: Path, timeout: float = TIMEOUT,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group; kill the whole group on timeout."""
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} still running after {timeout:g}s:\n{out[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # pool children left behind
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def test_the_docs_have_the_worked_examples() -> None:
    files = doc_files(TESTING_DOC)
    assert {"test_payments.py", "test_fencing.py", "conftest.py"} <= files.keys()
    assert all(kind == "pytest" for name, (kind, _) in files.items() if name.startswith("test_"))


@pytest.mark.parametrize("example", ["test_payments.py", "test_fencing.py"])
def test_worked_example_passes(example: str, tmp_path: Path) -> None:
    for name, (_, code) in doc_files(TESTING_DOC).items():
        (tmp_path / name).write_text(code)
    result = run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", example], tmp_path)
    assert result.returncode == 0, result.stdout[-4000:]
    tests = len(re.findall(r"^def test_", doc_files(TESTING_DOC)[example][1], re.M))
    assert f"{tests} passed" in result.stdout, result.stdout[-4000:]


def test_plain_context_manager_example_runs(tmp_path: Path) -> None:
    """The "Without pytest" sample: a script that starts and stops a worker itself."""
    text = TESTING_DOC.read_text()
    code = re.search(r"```python\n(# smoke\.py\n.*?)```", text, re.S)
    assert code is not None, "the smoke.py sample is missing from docs/testing.md"
    (tmp_path / "smoke.py").write_text(code.group(1))
    result = run_bounded([sys.executable, "smoke.py"], tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]
    assert re.search(r"smoke\.add: succeeded under epoch 1 by \S+@\S+", result.stdout), \
        result.stdout[-4000:]
