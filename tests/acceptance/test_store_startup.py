"""A ``celery worker -P pulse`` whose store can never be opened exits at once, saying why.

A missing database, refused credentials or a host that does not resolve will not get
better by waiting: the worker must not spend ``pulse_store_connect_timeout`` retrying
them and then report "store unavailable". A store that merely refuses connections
(starting up) is still waited for (tests/acceptance/test_registry.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import filesystem_broker
from tests.helpers import services
from tests.helpers.bad_stores import CASES, PASSWORD, BadStore
from tests.helpers.workers import ROOT, Env, Worker

#: Far longer than the worker needs to start and give up: a worker still retrying
#: when the test stops waiting has been retrying a store that can never answer.
RETRY_FOR = 60
#: Start-up (Celery's imports, the app) plus the failed connection, on a loaded machine.
GIVE_UP_WITHIN = 25


def _start(env_for: Callable[..., Env], workers: Callable[..., Worker], tmp: Path, url: str,
           **kwargs: object) -> Worker:
    broker, conf = filesystem_broker(tmp)
    env = env_for(url, broker, {**conf, "pulse_store_connect_timeout": RETRY_FOR},
                  migrate=False)
    return workers(env, "startup@%h", **kwargs)


def _refusal(w: Worker) -> str:
    """The worker's one start-up line, after it exited 78 (a configuration error)."""
    started = time.monotonic()
    assert w.wait(GIVE_UP_WITHIN) == 78, w.log()
    assert time.monotonic() - started < GIVE_UP_WITHIN
    lines = [ln for ln in w.log().splitlines() if "celery-pulse: cannot start" in ln]
    assert len(lines) == 1, w.log()
    assert "Traceback" not in w.log(), w.log()
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_worker_on_a_store_that_cannot_be_opened_exits_at_once(
        case: BadStore, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    services.require(case.service)
    line = _refusal(_start(make_env, workers, tmp_path, case.url))
    assert case.names in line and "pulse_store_url" in line, line
    assert PASSWORD not in line
    assert "unavailable" not in line, line


def test_a_postgres_url_without_psycopg_says_what_to_install(
        tmp_path: Path, make_env: Callable[..., Env], workers: Callable[..., Worker]) -> None:
    """``postgres://`` (Django's form) on an install without the ``postgres`` extra."""
    blocked = tmp_path / "no-psycopg" / "psycopg"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'psycopg\'", name="psycopg")\n')
    path = os.pathsep.join([str(blocked.parent), str(ROOT)])
    w = _start(make_env, workers, tmp_path, "postgres://root@127.0.0.1/test",
               extra_env={"PYTHONPATH": path})
    line = _refusal(w)
    assert line.endswith('pulse_store_url: the psycopg driver is not installed: '
                         'pip install "celery-pulse-leases[postgres]"'), line
