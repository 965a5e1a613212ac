"""Flower's Pool tab under ``-P pulse``: grow, shrink, autoscale and restart are refused
with a reply that says why (issue 34, item 3), by a real worker, through ``celery
control`` and through a real Flower's API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest

from celery_pulse.worker.pool_controls import REFUSED, refusal
from tests.acceptance.test_operate import _get_json, flower, ops_env  # noqa: F401 - fixtures
from tests.helpers.workers import Env, Worker, wait_for

ARGS = {"pool_grow": ("1",), "pool_shrink": ("1",), "autoscale": ("4", "1"),
        "pool_restart": ()}


def _processes(env: Env, name: str) -> int:
    stats = env.celery_json("inspect", "stats", "-d", name)
    return len(stats[name]["pool"]["processes"])


@pytest.mark.parametrize("command", sorted(REFUSED))
def test_celery_control_pool_command_is_refused_with_the_reason(
        ops_env: Env, workers: Callable[..., Worker], command: str) -> None:  # noqa: F811
    """Passes if ``celery control <command>`` gets the reply ``{"error": "<command> is not
    supported by -P pulse: ..."}`` (shown as an ERROR with the reason without ``--json``),
    the worker logs one WARNING naming the command, and
    the pool keeps its one process."""
    w = workers(ops_env, "pc@%h").wait_ready(60)
    name = w.wait_log(r"pulse: registered (\S+)").group(1)
    proc = ops_env.celery("control", command, *ARGS[command], "-d", name, "--json",
                          timeout=60)
    replies = json.loads(proc.stdout)
    assert replies == [{name: {"error": refusal(command)}}], (proc.stdout, proc.stderr)
    assert "is not supported by -P pulse" in refusal(command)
    plain = ops_env.celery("control", command, *ARGS[command], "-d", name, timeout=60)
    assert f"{name}: ERROR" in plain.stdout and refusal(command) in plain.stdout, plain.stdout
    w.wait_log(rf"WARNING.*pulse: refused remote control command {command}")
    assert _processes(ops_env, name) == 1


def test_flowers_pool_grow_shows_the_refusal(
        ops_env: Env, flower: str, workers: Callable[..., Worker]) -> None:  # noqa: F811
    """Passes if Flower's ``POST /api/worker/pool/grow/<name>`` answers 403 with the
    worker's reason, and the pool did not grow."""
    w = workers(ops_env, "pf@%h", extra=("-E",)).wait_ready(60)
    name = w.wait_log(r"pulse: registered (\S+)").group(1)
    wait_for(lambda: name in _get_json(f"{flower}/api/workers?refresh=1"), 60,
             "Flower to know the worker", interval=1.0)
    for command, path in (("pool_grow", "grow"), ("pool_shrink", "shrink")):
        request = urllib.request.Request(f"{flower}/api/worker/pool/{path}/{name}?n=1",
                                         data=b"", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        body = info.value.read().decode()
        assert info.value.code == 403
        assert refusal(command) in body, body
    autoscale = urllib.request.Request(f"{flower}/api/worker/pool/autoscale/{name}?min=1&max=4",
                                       data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(autoscale, timeout=30)
    assert refusal("autoscale") in info.value.read().decode()
    assert _processes(ops_env, name) == 1


def test_autoscale_option_fails_at_startup(ops_env: Env,  # noqa: F811
                                           workers: Callable[..., Worker]) -> None:
    """``--autoscale`` with ``-P pulse``: exit 78 and one line saying why."""
    w = workers(ops_env, "pa@%h", extra=("--autoscale=4,1",))
    assert w.wait(60) == 78
    line = next(x for x in w.log().splitlines() if x.startswith("celery-pulse: cannot start"))
    assert "--autoscale is not supported by -P pulse" in line, line

