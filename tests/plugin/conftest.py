"""Shared by the plugin's tests: the cluster tasks on every node, the journal, the bounds.

The plugin itself (``celery_pulse.contrib.pytest_celery``) is loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from celery_pulse.testing import FAST_SETTINGS
from tests.apps import clustertasks

#: Kill -> takeover bound with FAST_SETTINGS (DESIGN §3.4), plus scheduling slack.
BOUND = FAST_SETTINGS["pulse_lease_ttl"] + FAST_SETTINGS["pulse_recover_interval"] + 1.0 + 3.0
#: How long we watch for a re-run that must not happen: a lease and a few scans.
OBSERVE = FAST_SETTINGS["pulse_lease_ttl"] + 4 * FAST_SETTINGS["pulse_recover_interval"]


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    task_id: str
    epoch: int
    host: str


def journal(path: Path, task_id: str, kind: str | None = None) -> list[Event]:
    if not path.exists():
        return []
    events = [Event(k, t, int(e), h) for k, t, e, h, _ in
              (line.split() for line in path.read_text().splitlines() if line.endswith(tuple("0123456789")))]
    return [e for e in events if e.task_id == task_id and (kind is None or e.kind == kind)]


@pytest.fixture
def default_worker_tasks(default_worker_tasks: set[Any]) -> set[Any]:
    """pytest-celery's own tasks and ours."""
    return {*default_worker_tasks, clustertasks}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """(journal, gate): the tasks hold until the gate file exists."""
    return tmp_path / "journal.txt", tmp_path / "gate"
