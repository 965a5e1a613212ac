"""The worker registry with real ``celery worker -P pulse`` processes (issue: foundation)."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from kombu import Connection

from tests.helpers.pg import PrivatePostgres
from tests.helpers.workers import Env, Worker, wait_for

FAST = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5}


def _workers(env: Env) -> dict[str, dict[str, Any]]:
    return {w["id"].split("@")[0]: w for w in env.celery_json("pulse", "workers")}


def test_workers_listed_alive_and_takeover_stops_the_old_one(
        stack: tuple[str, str, dict[str, Any]], make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    store, broker, conf = stack
    # RabbitMQ itself refuses a second live worker of the same name (its remote-control
    # queue is exclusive), so the newcomer could never start there: switch remote
    # control off to exercise pulse's own identity fencing.
    env = make_env(store, broker, {**conf, **FAST, "worker_enable_remote_control": False})
    a = workers(env, "a@%h").wait_ready()
    workers(env, "b@%h").wait_ready()
    listed = wait_for(lambda: (w := _workers(env)).keys() >= {"a", "b"} and w, 20,
                      "a and b in `pulse workers`")
    assert listed["a"]["alive"] and listed["b"]["alive"]
    assert listed["a"]["labels"]["pool"] == "pulse"
    assert listed["a"]["labels"]["pid"] == a.pid

    newcomer = workers(env, "a@%h")
    taken_over = _log_time(newcomer.wait_log(r"\[([^\]]+): INFO/MainProcess\] pulse: registered a@"))
    lost = _log_time(a.wait_log(r"\[([^\]]+): CRITICAL/MainProcess\] pulse: worker a@\S+ lost its "
                                r"identity: .*another process registered this name"))
    # Noticed at the next heartbeat: within one interval (+ scheduling slack).
    assert lost - taken_over <= FAST["pulse_heartbeat_interval"] + 0.3, (taken_over, lost)
    code = a.wait(timeout=15)
    assert code == 3, a.log()[-2000:]
    assert _workers(env)["a"]["alive"]  # the newcomer keeps the name
    assert _workers(env)["a"]["labels"]["pid"] == newcomer.pid


def _log_time(match: re.Match[str]) -> float:
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_sigkill_shows_dead_by_store_clock(stack: tuple[str, str, dict[str, Any]],
                                           make_env: Callable[..., Env],
                                           workers: Callable[..., Worker]) -> None:
    store, broker, conf = stack
    env = make_env(store, broker, {**conf, **FAST})
    w = workers(env, "k@%h").wait_ready()
    wait_for(lambda: _workers(env).get("k", {}).get("alive"), 10, "k alive")
    w.kill()
    killed = time.time()

    def dead() -> tuple[float, float] | None:
        row = _workers(env)["k"]
        return None if row["alive"] else (row["expires_in"], time.time())

    # A listing is a CLI process (seconds on a loaded machine): when it shows k dead says
    # little. Its ``expires_in`` says when k's lease ran out by the store's clock (the
    # same machine's): the read came before ``read_by``, ``expires_in`` (negative) after
    # the lease's end, so the end is at most ``read_by + expires_in``.
    expires_in, read_by = wait_for(dead, FAST["pulse_worker_ttl"] + 20, "k dead")
    assert expires_in <= 0
    # The lease ends ttl after the last heartbeat, which came before the kill; the slack
    # (an interval and a second) is the listing's exit after its read.
    assert read_by + expires_in - killed <= (
        FAST["pulse_worker_ttl"] + FAST["pulse_heartbeat_interval"] + 1.0)


def test_warm_shutdown_deregisters(stack: tuple[str, str, dict[str, Any]],
                                   make_env: Callable[..., Env],
                                   workers: Callable[..., Worker]) -> None:
    store, broker, conf = stack
    env = make_env(store, broker, {**conf, **FAST})
    w = workers(env, "t@%h").wait_ready()
    wait_for(lambda: "t" in _workers(env), 10, "t registered")
    w.signal_main(signal.SIGTERM)
    assert w.wait(30) == 0, w.log()[-2000:]
    assert "t" not in _workers(env)


def test_worker_pool_setting_selects_pulse_without_flag(
        sqlite_url: str, tmp_path: Any, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    from tests.conftest import filesystem_broker

    broker, conf = filesystem_broker(tmp_path)
    env = make_env(sqlite_url, broker, {**conf, **FAST, "worker_pool": "pulse"})
    workers(env, "cfg@%h", pool="prefork").wait_ready()
    wait_for(lambda: "cfg" in _workers(env), 10, "worker registered through worker_pool")


def _queue_depth(broker: str, queue: str) -> int:
    with Connection(broker) as conn:
        _, count, _ = conn.default_channel.queue_declare(queue, passive=True)
        return int(count)


def test_store_outage_stops_consuming_then_resumes(
        private_pg: PrivatePostgres, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    env = make_env(private_pg.url, rabbitmq_url, FAST)
    w = workers(env, "o@%h").wait_ready()
    marker = env.tmp / "ran.txt"
    from tests.apps.pulseapp import app

    app.conf.broker_url = rabbitmq_url
    private_pg.stop()
    stopped = time.monotonic()
    w.wait_log(r"stopped consuming", timeout=FAST["pulse_worker_ttl"] + 5)
    assert time.monotonic() - stopped < FAST["pulse_worker_ttl"] + 3
    app.send_task("pulseapp.touch", args=[str(marker)], queue=env.queue)
    # While fenced the message stays in the broker: observe it there for a while.
    deadline = time.monotonic() + 2 * FAST["pulse_worker_ttl"]
    while time.monotonic() < deadline:
        assert _queue_depth(rabbitmq_url, env.queue) == 1
        assert not marker.exists()
        time.sleep(0.25)
    private_pg.start()
    wait_for(marker.exists, 30, "the queued task to run after the store came back")
    assert "re-registered" in w.log() or "registered again" in w.log()
    assert w.proc.poll() is None  # no restart needed


@pytest.mark.parametrize(("conf", "expected"), [
    ({"pulse_heartbeat_interval": 5, "pulse_worker_ttl": 5}, "pulse_heartbeat_interval"),
    ({"pulse_lease_ttl": -1}, "pulse_lease_ttl"),
    ({"pulse_store_url": "mongodb://x/y"}, "pulse_store_url"),
])
def test_bad_settings_exit_with_one_clear_line(
        conf: dict[str, Any], expected: str, sqlite_url: str, tmp_path: Any,
        make_env: Callable[..., Env], workers: Callable[..., Worker]) -> None:
    from tests.conftest import filesystem_broker

    broker, bconf = filesystem_broker(tmp_path)
    env = make_env(sqlite_url, broker, {**bconf, **conf}, migrate=False)
    w = workers(env, "bad@%h")
    assert w.wait(30) == 78
    lines = [ln for ln in w.log().splitlines() if "celery-pulse: cannot start" in ln]
    assert len(lines) == 1 and expected in lines[0], w.log()
    assert "Traceback" not in w.log()


def test_unreachable_store_names_setting_and_masks_password(
        tmp_path: Any, make_env: Callable[..., Env], workers: Callable[..., Worker]) -> None:
    from tests.conftest import filesystem_broker

    broker, bconf = filesystem_broker(tmp_path)
    url = "postgresql+psycopg://user:s3cret@127.0.0.1:1/nowhere"
    env = make_env(url, broker, {**bconf, "pulse_store_connect_timeout": 1}, migrate=False)
    w = workers(env, "unreach@%h")
    assert w.wait(30) == 78
    assert "pulse_store_url" in w.log() and "s3cret" not in w.log(), w.log()


def test_missing_schema_says_to_migrate(stack: tuple[str, str, dict[str, Any]],
                                        make_env: Callable[..., Env],
                                        workers: Callable[..., Worker]) -> None:
    store, broker, conf = stack
    env = make_env(store, broker, conf, migrate=False)
    w = workers(env, "noschema@%h")
    assert w.wait(30) == 78
    assert "pulse migrate" in w.log() and "Traceback" not in w.log(), w.log()
    cli = env.celery("pulse", "workers")
    assert cli.returncode != 0 and "pulse migrate" in cli.stderr
    assert env.celery("pulse", "migrate").returncode == 0
    assert env.celery("pulse", "workers").returncode == 0
