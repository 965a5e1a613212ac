"""Mistakes a user makes fail at startup, and secrets stay hidden (issue 32).

Real ``celery worker -P pulse`` processes and ``celery`` CLI calls: a misspelt setting or
task option stops the worker naming it and the closest known name; ``-P pulse`` on an app
that never called ``celery_pulse.install(app)`` exits 78 with the line that fixes it; a
pulse worker's banner names the pulse pool; ``celery inspect conf`` (answered to anyone on
the broker), ``inspect stats``, ``pulse status`` and the worker's log never show the
store's password.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from tests.conftest import filesystem_broker
from tests.helpers.workers import Env, Worker

APP = "tests.apps.mistakesapp"
EX_CONFIG = 78
PASSWORD = "secretpw"


def _embedded_env(make_env: Callable[..., Env], sqlite_url: str, tmp_path: Path,
                  conf: dict[str, object]) -> Env:
    broker, broker_conf = filesystem_broker(tmp_path)
    env = make_env(sqlite_url, broker, {**broker_conf, **conf})
    env.app = APP
    return env


def test_a_misspelt_setting_stops_the_worker_and_the_cli_naming_it(
        make_env: Callable[..., Env], workers: Callable[..., Worker], sqlite_url: str,
        tmp_path: Path) -> None:
    env = _embedded_env(make_env, sqlite_url, tmp_path, {"pulse_lease_tll": 10})
    worker = workers(env, "typo@mistakes")
    assert worker.wait(60) == EX_CONFIG, worker.log()[-3000:]
    line = "unknown setting pulse_lease_tll (did you mean pulse_lease_ttl?)"
    assert line in worker.log()
    assert "ready." not in worker.log()

    status = env.celery("pulse", "status")
    assert status.returncode != 0
    assert line in status.stderr


def test_an_unknown_task_option_stops_the_worker_naming_the_task(
        make_env: Callable[..., Env], workers: Callable[..., Worker], sqlite_url: str,
        tmp_path: Path) -> None:
    env = _embedded_env(make_env, sqlite_url, tmp_path, {})
    worker = workers(env, "option@mistakes",
                     extra_env={"PULSE_TEST_TASK_OPTION": "pulse_idempotant"})
    assert worker.wait(60) == EX_CONFIG, worker.log()[-3000:]
    assert ("task mistakesapp.echo: unknown option pulse_idempotant "
            "(did you mean pulse_idempotent?)") in worker.log()


def test_the_pulse_pool_without_install_exits_78_saying_what_fixes_it(
        make_env: Callable[..., Env], workers: Callable[..., Worker], sqlite_url: str,
        tmp_path: Path) -> None:
    env = _embedded_env(make_env, sqlite_url, tmp_path, {})
    worker = workers(env, "bare@mistakes", extra_env={"PULSE_TEST_NO_INSTALL": "1"})
    assert worker.wait(60) == EX_CONFIG, worker.log()[-3000:]
    lines = [line for line in worker.log().splitlines() if "celery-pulse" in line]
    assert len(lines) == 1, worker.log()[-3000:]
    assert "call celery_pulse.install(app) in the module that creates the app" in lines[0]
    assert "ready." not in worker.log()


def test_inspect_conf_stats_status_and_logs_hide_the_store_password(
        make_env: Callable[..., Env], workers: Callable[..., Worker], pg_url: str,
        rabbitmq_url: str) -> None:
    # PostgreSQL here trusts 127.0.0.1: any password connects, and must never be shown.
    store_url = sa.make_url(pg_url).set(password=PASSWORD).render_as_string(
        hide_password=False)
    assert PASSWORD in store_url
    env = make_env(store_url, rabbitmq_url, {"pulse_beat_catchup": "all"})
    env.app = APP
    worker = workers(env, "secret@mistakes").wait_ready(60)
    # The banner names the pulse pool (Celery prints the pool module's last part).
    assert "concurrency: 1 (pulse_prefork)" in worker.log()

    conf = env.celery("inspect", "conf", "-d", worker.name, "--timeout", "10", "--json")
    assert conf.returncode == 0, conf.stderr
    assert PASSWORD not in conf.stdout + conf.stderr
    shown = json.loads(conf.stdout)[worker.name]
    masked = sa.make_url(store_url).render_as_string(hide_password=False).replace(
        PASSWORD, "***")
    assert shown["pulse_store_url"] == masked
    assert shown["pulse_beat_catchup"] == "all"  # a setting without a secret stays visible

    everything = conf.stdout
    for args in (("inspect", "conf", "true", "-d", worker.name, "--timeout", "10", "--json"),
                 ("inspect", "stats", "-d", worker.name, "--timeout", "10", "--json"),
                 ("pulse", "status"), ("pulse", "status", "--json")):
        proc = env.celery(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert PASSWORD not in proc.stdout + proc.stderr, args
        everything += proc.stdout
    assert worker.name in everything and masked in everything
    assert PASSWORD not in worker.log()


def test_a_misspelt_setting_under_celerys_namespace_is_named_as_written(
        make_env: Callable[..., Env], workers: Callable[..., Worker], sqlite_url: str,
        tmp_path: Path) -> None:
    env = _embedded_env(make_env, sqlite_url, tmp_path, {})
    conf = {"CELERY_PULSE_LEASE_TLL": 10}
    worker = workers(env, "namespace@mistakes",
                     extra_env={"PULSE_TEST_NAMESPACE_CONF": json.dumps(conf)})
    assert worker.wait(60) == EX_CONFIG, worker.log()[-3000:]
    assert ("unknown setting CELERY_PULSE_LEASE_TLL (did you mean CELERY_PULSE_LEASE_TTL?)"
            in worker.log())
