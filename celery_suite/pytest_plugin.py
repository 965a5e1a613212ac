"""pytest plugin (``-p celery_suite.pytest_plugin``): point Celery's t/integration at an external worker.

Why a patch and not a fixture: t/integration/conftest.py re-exports
``celery_session_worker`` from ``celery.contrib.pytest``, and a conftest fixture
always shadows a ``-p`` plugin's fixture of the same name. Both that fixture and
``celery_worker`` start their in-process worker through
``celery.contrib.testing.worker.start_worker``, looked up when the fixture runs, so
replacing that one function here turns every in-process worker into a no-op,
whatever fixture the tests ask for. The session fixture still imports
``celery_includes`` and registers ``celery_class_tasks`` in the test process's app.

Environment (set by ``python -m celery_suite run``):

* ``CELERY_SUITE_NODENAME``: the external worker's node name; test_inspect addresses
  "the worker" by the test process's ``anon_nodename()``, which was the in-process one.
* ``CELERY_SUITE_WORKER_PID``: stop the session (the rest is "not run") once it is gone.
* ``CELERY_SUITE_DEADLINE``: epoch seconds; no test starts after it (CI budget).
* ``CELERY_SUITE_TIMEOUT``: cap on every test's timeout, upstream ``timeout(300)`` marks too.
* ``CELERY_SUITE_OUTCOMES``: JSON file this plugin writes (collected ids, outcomes, times).
* ``CELERY_SUITE_ONLY``: file of test ids; the others are deselected (module order is kept,
  which passing the ids as arguments would not guarantee).

The test process also stamps each task it publishes with its publication identity, as
an app that called ``celery_pulse.install`` does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

_OUTCOMES: dict[str, str] = {}
_MESSAGES: dict[str, str] = {}
_COLLECTED: list[str] = []
_STOPPED: list[str] = []
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3}


@contextmanager
def _external_worker(app: Any, *_args: Any, **_kwargs: Any) -> Iterator[Any]:
    """Stand-in for ``start_worker``: the worker already runs in its own process."""
    yield SimpleNamespace(app=app, hostname=os.environ.get("CELERY_SUITE_NODENAME", ""), external=True)


def pytest_configure(config: pytest.Config) -> None:
    from celery.contrib.testing import worker
    from celery.signals import before_task_publish

    from celery_pulse.install import stamp_publication

    worker.start_worker = _external_worker
    # The test process publishes as a pulse user's app does (``celery_pulse.install``
    # stamps each publication); the header is inert under prefork.
    before_task_publish.connect(stamp_publication, weak=False,
                                dispatch_uid="celery-pulse-publication")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    from celery.utils.nodenames import anon_nodename

    only_file = os.environ.get("CELERY_SUITE_ONLY")
    if only_file:
        with open(only_file) as fh:
            only = {line.strip() for line in fh if line.strip()}
        deselected = [item for item in items if item.nodeid not in only]
        items[:] = [item for item in items if item.nodeid in only]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
    cap = float(os.environ.get("CELERY_SUITE_TIMEOUT", "0") or 0)
    nodename = os.environ.get("CELERY_SUITE_NODENAME")
    local = anon_nodename()
    for item in items:
        if cap:
            mark = item.get_closest_marker("timeout")
            current = None
            if mark is not None:
                current = mark.kwargs.get("timeout", mark.args[0] if mark.args else None)
            if current is None or float(current) > cap:
                item.add_marker(pytest.mark.timeout(cap), append=False)
        module = getattr(item, "module", None)
        if nodename and module is not None and getattr(module, "NODENAME", None) == local:
            module.NODENAME = nodename
    _COLLECTED[:] = [item.nodeid for item in items]
    _write_outcomes()


def _worker_alive() -> bool:
    pid = int(os.environ.get("CELERY_SUITE_WORKER_PID", "0") or 0)
    if not pid:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Run nothing more once the worker is gone or the time budget is spent."""
    deadline = float(os.environ.get("CELERY_SUITE_DEADLINE", "0") or 0)
    reason = ""
    if not _worker_alive():
        reason = "the external worker exited"
    elif deadline and time.time() > deadline:
        reason = "the time budget (--budget) is spent"
    if reason:
        if not _STOPPED:
            _STOPPED.append(reason)
        item.session.shouldstop = reason
        return True  # handled: the item is not run (it counts as "not run")
    return None


_STARTED: dict[str, float] = {}
_WALL: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _STARTED[nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    """Per-test wall time (all phases), and the outcomes so far: a killed pytest still leaves them."""
    _WALL[nodeid] = time.monotonic() - _STARTED.get(nodeid, time.monotonic())
    _write_outcomes()


def _record(report: pytest.TestReport) -> None:
    if getattr(report, "wasxfail", None) is not None:
        outcome = "xpassed" if report.passed and report.when == "call" else "xfailed"
    elif report.failed:
        outcome = "failed"
    elif report.skipped:
        outcome = "skipped"
    elif report.when == "call":
        outcome = "passed"
    else:
        outcome = _OUTCOMES.get(report.nodeid, "")
    previous = _OUTCOMES.get(report.nodeid, "")
    if outcome and _RANK.get(outcome, 0) >= _RANK.get(previous, -1):
        _OUTCOMES[report.nodeid] = outcome
    if report.failed and report.nodeid not in _MESSAGES:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or str(report.longrepr).strip().splitlines()[-1:]
        _MESSAGES[report.nodeid] = f"{report.when}: {str(text).splitlines()[0][:300]}"


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record the outcome; end a test whose subtests keep it running past the timeout cap.

    pytest-timeout fails a test once, by raising inside it; a ``subtests.test()`` block
    swallows that like any failure and the test goes on (upstream's chord errback tests
    then run for minutes). A subtest's report is logged from that block's ``__exit__``,
    so raising here is what ends the test.
    """
    _record(report)
    cap = float(os.environ.get("CELERY_SUITE_TIMEOUT", "0") or 0)
    is_subtest = type(report).__name__ == "SubtestReport"
    started = _STARTED.get(report.nodeid)
    if cap and is_subtest and started is not None and time.monotonic() - started > cap + 5:
        pytest.fail(f"celery-suite: past the {cap:g} s per-test timeout cap inside subtests", pytrace=False)


def _write_outcomes(exitstatus: int | None = None) -> None:
    path = os.environ.get("CELERY_SUITE_OUTCOMES")
    if not path:
        return
    data = {"collected": _COLLECTED, "outcomes": _OUTCOMES, "messages": _MESSAGES,
            "durations": _WALL, "stopped": _STOPPED[0] if _STOPPED else "",
            "exitstatus": exitstatus}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_outcomes(int(exitstatus))
