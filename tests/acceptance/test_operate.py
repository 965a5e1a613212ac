"""Operating pulse: Flower shows it, drain, metrics (issue: operate)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from tests.helpers.services import IN_CI
from tests.helpers.workers import ROOT, Env, Worker, wait_for

FAST = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
        "pulse_renew_interval": 0.5, "pulse_revoke_grace": 2, "pulse_leader_ttl": 3,
        "pulse_leader_interval": 1}
ARTIFACTS = ROOT / "test-artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _get_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


@pytest.fixture
def ops_env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    env = make_env(pg_url, rabbitmq_url, {**FAST, "worker_send_task_events": True,
                                          "task_send_sent_event": True,
                                          "result_backend": "pulse://"})
    env.app = "tests.apps.opsapp"
    return env


@pytest.fixture
def flower(ops_env: Env) -> Iterator[str]:
    port = _free_port()
    log = open(ops_env.tmp / "flower.log", "w")  # noqa: SIM115 - closed below
    env = ops_env.vars()
    env["FLOWER_UNAUTHENTICATED_API"] = "true"
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", ops_env.app, "flower",
                             f"--port={port}", "--address=127.0.0.1"], env=env,
                            cwd=ops_env.tmp, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get_text(url + "/healthcheck"), 60, "flower to answer")
        yield url
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _take_over(store_url: str, task_id: str) -> None:
    """What another worker's Recover would do: a new epoch for someone else."""
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        now = conn.execute(sa.text("select extract(epoch from clock_timestamp())")).scalar_one()
        done = conn.execute(sa.text(
            "update pulse_claims set epoch = epoch + 1, holder = 'thief', token = :t, "
            "lease_until = :until where task_id = :id and state = 'running'"),
            {"t": "f" * 32, "until": float(now) + 60, "id": task_id}).rowcount
    engine.dispose()
    assert done == 1


def test_flower_shows_pulse_stats_and_no_failure_of_a_stale_attempt(
        ops_env: Env, flower: str, workers: Callable[..., Worker]) -> None:
    worker = workers(ops_env, "fl@%h", extra=("-E",)).wait_ready()
    name = worker.wait_log(r"pulse: registered (\S+)").group(1)

    def pulse_section() -> dict[str, Any] | None:
        data = _get_json(f"{flower}/api/workers?refresh=1")
        return (data.get(name, {}).get("stats") or {}).get("pulse")

    section = wait_for(pulse_section, 60, "the pulse section in Flower's /api/workers",
                       interval=1.0)
    assert section["worker_id"] == name
    assert section["registration"]["state"] == "active"
    assert "leases" in section and "renew_latency" in section

    from tests.apps.opsapp import app

    app.conf.broker_url = ops_env.broker_url
    marker = ops_env.tmp / "hold.txt"
    result = app.send_task("opsapp.hold", args=[60, str(marker)], queue=ops_env.queue)
    wait_for(lambda: marker.exists() and "start" in marker.read_text(), 30, "task start")
    _take_over(ops_env.store_url, result.id)
    wait_for(lambda: "lost" in marker.read_text(), 10, "LeaseLost inside the task")

    # The stale attempt's end goes out as pulse-attempt-ended, not as task-failed: the
    # attempt that holds the task (the thief's, epoch 2) decides its state in Flower.
    worker.wait_log(rf"task {result.id} epoch 1 ended failed as a stale attempt")
    after = app.send_task("opsapp.hold", args=[0, str(ops_env.tmp / "after.txt")],
                          queue=ops_env.queue)

    def shown(task_id: str, state: str) -> dict[str, Any] | None:
        try:
            task = _get_json(f"{flower}/api/task/info/{task_id}")
        except urllib.error.HTTPError as exc:  # 404 until Flower has seen the task
            if exc.code != 404:
                raise
            return None
        return task if task.get("state") == state else None

    # Flower has the worker's events up to a later task's end: the stale one's are in.
    wait_for(lambda: shown(after.id, "SUCCESS"), 30, "a later task to show SUCCESS in Flower",
             interval=0.5)
    task = _get_json(f"{flower}/api/task/info/{result.id}")
    assert task.get("state") == "STARTED", task
    assert not task.get("exception") and not task.get("failed"), task
    _screenshot(f"{flower}/worker/{name}", ARTIFACTS / "flower-worker.png")


def test_flower_reads_results_from_the_pulse_backend(
        ops_env: Env, flower: str, workers: Callable[..., Worker]) -> None:
    """Flower's result API resolves ``pulse://`` from the app's settings alone."""
    workers(ops_env, "flr@%h", extra=("-E",)).wait_ready()
    client = Celery("flower-results-client", broker=ops_env.broker_url, backend="pulse://",
                    set_as_current=False)
    client.conf.update(pulse_store_url=ops_env.store_url, task_default_queue=ops_env.queue)
    try:
        result = client.send_task("opsapp.hold", args=[0, str(ops_env.tmp / "r.txt")])
        assert result.get(timeout=30) == "done"
    finally:
        client.close()

    def shown() -> dict[str, Any] | None:
        data = _get_json(f"{flower}/api/task/result/{result.id}")
        return data if data.get("state") == "SUCCESS" else None

    data = wait_for(shown, 30, "Flower to show the task's result", interval=0.5)
    assert data["result"] == "done"


def _screenshot(url: str, path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if IN_CI:
            pytest.fail("chromium is not installed (CI=true: .ci/run installs it)")
        pytest.skip("chromium is not installed: no screenshot of Flower's worker page")
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={path.parent / 'chromium-profile'}",
                    "--window-size=1280,1600", f"--screenshot={path}", url],
                   check=True, capture_output=True, timeout=120)
    assert path.stat().st_size > 10_000


def test_drain_finishes_in_flight_then_exits_and_stays_drained(
        ops_env: Env, workers: Callable[..., Worker]) -> None:
    worker = workers(ops_env, "dr@%h").wait_ready()
    name = worker.wait_log(r"pulse: registered (\S+)").group(1)
    from tests.apps.opsapp import app

    app.conf.broker_url = ops_env.broker_url
    marker = ops_env.tmp / "drain.txt"
    app.send_task("opsapp.hold", args=[3, str(marker)], queue=ops_env.queue)
    wait_for(lambda: marker.exists() and "start" in marker.read_text(), 30, "task start")
    proc = ops_env.celery("pulse", "drain", name, "--wait", "--timeout", "60", timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert worker.wait(30) == 0
    assert marker.read_text().splitlines() == ["start 1", "end"]  # finished, not cut short
    claims = ops_env.celery_json("pulse", "claims", "--state", "succeeded")
    assert len(claims) == 1 and claims[0]["holder"] == name
    assert name not in {w["id"] for w in ops_env.celery_json("pulse", "workers")}

    again = workers(ops_env, "dr@%h")  # the same name restarts: still drained
    assert again.wait(60) == 0
    assert "drain requested" in again.log()
    assert ops_env.celery("pulse", "undrain", name).returncode == 0
    workers(ops_env, "dr@%h").wait_ready()
    wait_for(lambda: name in {w["id"] for w in ops_env.celery_json("pulse", "workers")}, 20,
             "the undrained worker to register")


def test_status_exits_nonzero_without_a_leader_while_a_schedule_exists(
        ops_env: Env, workers: Callable[..., Worker]) -> None:
    ops_env.conf["pulse_beat"] = False  # nobody campaigns
    assert ops_env.celery("pulse", "schedule", "add", "every-second", "--task", "opsapp.noop",
                          "--every", "1").returncode == 0
    proc = ops_env.celery("pulse", "status")
    assert proc.returncode == 1
    assert "no beat leader" in proc.stdout
    ops_env.conf["pulse_beat"] = True
    workers(ops_env, "st@%h").wait_ready()
    wait_for(lambda: ops_env.celery("pulse", "status").returncode == 0, 30,
             "status to be healthy once a leader exists")
    payload = json.loads(ops_env.celery("pulse", "status", "--json").stdout)
    assert payload["leader"]["alive"] and payload["needs_attention"] == []


def test_prometheus_metrics(ops_env: Env, workers: Callable[..., Worker]) -> None:
    pytest.importorskip("prometheus_client")
    port = _free_port()
    ops_env.conf["pulse_metrics_port"] = port
    workers(ops_env, "pm@%h").wait_ready()
    text = wait_for(lambda: _get_text(f"http://127.0.0.1:{port}/metrics"), 30, "/metrics")
    assert "pulse_reserved_total" in text or "pulse_reserved" in text
    assert "pulse_is_leader" in text


def test_sigterm_keeps_renewing_and_records_completion(
        ops_env: Env, workers: Callable[..., Worker]) -> None:
    worker = workers(ops_env, "wt@%h").wait_ready()
    from tests.apps.opsapp import app

    app.conf.broker_url = ops_env.broker_url
    marker = ops_env.tmp / "warm.txt"
    result = app.send_task("opsapp.hold", args=[8, str(marker)], queue=ops_env.queue)
    wait_for(lambda: marker.exists() and "start" in marker.read_text(), 30, "task start")
    worker.signal_main(signal.SIGTERM)
    assert worker.wait(60) == 0
    # 8 s > 2 x lease_ttl: the lease was renewed through the warm shutdown.
    assert marker.read_text().splitlines() == ["start 1", "end"]
    claims = ops_env.celery_json("pulse", "claims", "--state", "succeeded")
    assert [c["task_id"] for c in claims] == [result.id]
