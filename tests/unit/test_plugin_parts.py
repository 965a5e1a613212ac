"""Pieces of celery_pulse.contrib.pytest_celery that need no worker: signals, config hand-over."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_pulse.contrib.pytest_celery.nodes import find_app_ref, picklable_config
from celery_pulse.contrib.pytest_celery.process import LocalProcess, as_signal
from celery_pulse.testing import wait_for

#: A module-level app: a worker node would import this module to run it.
home_app = Celery("plugin-parts-home")


def test_signal_names() -> None:
    assert as_signal("SIGTERM") == as_signal("term") == as_signal(15) == signal.SIGTERM


def test_config_reaches_the_worker_as_set_or_the_setting_is_named() -> None:
    from datetime import timedelta

    app = Celery("plugin-parts")
    app.config_from_object({"result_expires": timedelta(minutes=5), "task_default_queue": "q"})
    assert picklable_config(app, strict=True) == {"result_expires": timedelta(minutes=5),
                                                  "task_default_queue": "q"}
    app.conf.task_routes = lambda *a, **k: None  # not picklable
    with pytest.raises(ValueError, match="'task_routes'"):
        picklable_config(app, strict=True)
    assert "task_routes" not in picklable_config(app, strict=False)


def test_module_level_apps_are_found_fresh_ones_are_not() -> None:
    assert find_app_ref(home_app) == f"{__name__}:home_app"
    assert find_app_ref(Celery("made-on-the-fly")) is None


def test_local_process_statuses_and_group_signals(tmp_path: Path) -> None:
    proc = LocalProcess("sleeper", [sys.executable, "-c", "print('up', flush=True); import time; "
                                    "time.sleep(60)"], env={}, cwd=tmp_path, ready_prompt="up")
    assert proc.status == "created"
    proc.start()
    try:
        assert proc.ready(10) and proc.status == "running"
        proc.kill("SIGSTOP")
        assert proc.status == "paused"
        wait_for(lambda: (Path(f"/proc/{proc.pid}/stat").read_text().split()[2] == "T"), 5,
                 "the process to stop")
        proc.kill("SIGCONT")
        assert proc.status == "running"
        proc.kill()
        assert proc.status == "exited" and proc.returncode == -signal.SIGKILL
        assert "up" in proc.logs()
    finally:
        proc.teardown()


def test_docker_route_runs_migrate_then_the_pulse_pool_and_installs_pulse() -> None:
    """The container's command and the app.py pytest-celery generates from our template."""
    from pytest_celery import WorkerInitialContent

    from celery_pulse.contrib.pytest_celery import PulseWorkerContainer

    command = PulseWorkerContainer.command()
    assert command[:2] == ["sh", "-c"]
    migrate, worker = command[2].split(" && exec ")
    assert migrate == "celery -A app pulse migrate"
    assert "worker" in worker and "-P pulse" in worker

    app = Celery("celery_test_app")
    app.conf.update(pulse_store_url="postgresql+psycopg://db/pulse")
    content = WorkerInitialContent()
    content.set_app_module(PulseWorkerContainer.app_module())
    content.set_utils_module(PulseWorkerContainer.utils_module())
    content.add_modules("tasks", PulseWorkerContainer.tasks_modules())
    content.set_config_from_object(app)
    source = content.generate()["app.py"].decode()
    assert "celery_pulse.install(app)" in source
    assert "'pulse_store_url': 'postgresql+psycopg://db/pulse'" in source
    assert "imports = None" not in source and "config = None" not in source
    compile(source, "app.py", "exec")
