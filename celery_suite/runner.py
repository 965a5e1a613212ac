"""One run: private broker vhost and store database, one external worker, pytest on t/integration.

Isolation: Celery's conftest insists on the single queue ``celery`` (its
``ZZZZ_set_app_current`` fixture fails any test whose app knows another queue), and
the control commands the tests use (inspect, revoke, ping) broadcast to every worker
on the vhost. So each run gets its own RabbitMQ vhost (``rabbitmqctl``; if that is
unavailable, ``/`` with the ``celery`` queue purged first) and, under ``-P pulse`` or
with ``backend="pulse"``, its own PostgreSQL database, both removed afterwards. With
``backend="pulse"`` the worker, the readiness probe and the test process all use
``result_backend = pulse+<that database's URL>``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from celery_suite import CACHE_DIR, PROJECT_DIR, celery_version, deps_dir, suite_dir
from celery_suite.fetch import fetch

BROKER_HOST = "amqp://guest:guest@127.0.0.1:5672"
REDIS_URL = "redis://127.0.0.1:6379"
PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=root dbname=postgres connect_timeout=10"
PG_URL = "postgresql+psycopg://root@127.0.0.1:5432"
WORKER_READY_TIMEOUT = 120.0
WORKER_STOP_GRACE = 20.0


def log(msg: str) -> None:
    print(f"celery-suite: {msg}", flush=True)


@dataclass
class RunResult:
    """What one pytest run against one worker gave."""

    pool: str
    backend: str
    collected: list[str]
    outcomes: dict[str, str]
    messages: dict[str, str]
    durations: dict[str, float]
    stopped: str
    wall: float
    worker_log: Path
    pytest_log: Path
    module_wall: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> list[str]:
        return sorted(i for i in self.collected if self.outcomes.get(i) == "passed")

    @property
    def not_passed(self) -> list[str]:
        """Failed, errored, or never run (budget spent, worker gone): all "did not pass"."""
        return sorted(i for i in self.collected if self.outcomes.get(i) in ("failed", None, ""))

    def status(self, test_id: str) -> str:
        return self.outcomes.get(test_id) or "not run"

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for test_id in self.collected:
            key = self.status(test_id)
            out[key] = out.get(key, 0) + 1
        return out


def _run(cmd: Sequence[str], env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


@contextmanager
def private_vhost(run_id: str) -> Iterator[str]:
    """A vhost of our own, so no other worker answers our broadcasts or eats our tasks."""
    ctl = shutil.which("rabbitmqctl")
    name = f"celery_suite_{run_id}"
    made = False
    if ctl:
        try:
            made = _run([ctl, "add_vhost", name]).returncode == 0 and _run(
                [ctl, "set_permissions", "-p", name, "guest", ".*", ".*", ".*"]).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            made = False
    if not made:
        log("WARNING: no private RabbitMQ vhost (rabbitmqctl failed); using '/' and purging "
            "the 'celery' queue first")
        _purge_celery_queue(f"{BROKER_HOST}//")
    try:
        yield f"{BROKER_HOST}/{name}" if made else f"{BROKER_HOST}//"
    finally:
        if made and ctl:
            with suppress(OSError, subprocess.TimeoutExpired):
                _run([ctl, "delete_vhost", name])


def _purge_celery_queue(broker_url: str) -> None:
    """The tests hard-code the queue ``celery``: leftovers from an older run must go."""
    from kombu.connection import Connection

    with Connection(broker_url, connect_timeout=10) as conn, suppress(Exception):  # type: ignore[no-untyped-call]
        conn.default_channel.queue_purge("celery")


@contextmanager
def private_store(run_id: str) -> Iterator[str]:
    """A PostgreSQL database of our own for pulse's tables, dropped at the end."""
    import psycopg

    name = f"celery_suite_{run_id}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_URL}/{name}"
    finally:
        with suppress(Exception), psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _env(broker: str, backend: str, store: str, nodename: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(PROJECT_DIR), str(suite_dir()), str(deps_dir())]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update({
        "PYTHONPATH": os.pathsep.join(paths),
        "TEST_BROKER": broker,
        "TEST_BACKEND": backend,
        "REDIS_HOST": "127.0.0.1",  # t/integration/tasks.py's own Redis connection
        "REDIS_PORT": "6379",
        "CELERY_SUITE_STORE_URL": store,
        "CELERY_SUITE_NODENAME": nodename,
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _kill_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the leader (a worker's warm shutdown stops its own pool), then SIGKILL the group.

    The SIGKILL goes to the whole process group even when the leader is gone, so no pool
    process outlives the run.
    """
    with suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _wait_ready(proc: subprocess.Popen[bytes], broker: str, backend: str, nodename: str,
                worker_log: Path) -> None:
    """Ready = answers a ping on the control bus and has run ``celery.ping`` through its pool."""
    from celery import Celery

    probe = Celery("celery-suite-probe", broker=broker, backend=backend, set_as_current=False)
    probe.conf.broker_connection_retry_on_startup = True
    deadline = time.monotonic() + WORKER_READY_TIMEOUT
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {proc.returncode}; see {worker_log}")
            replies = probe.control.ping(destination=[nodename], timeout=1.0)
            if any(nodename in reply for reply in replies or []):
                break
        else:
            raise RuntimeError(f"the worker did not answer a ping in {WORKER_READY_TIMEOUT:.0f} s; "
                               f"see {worker_log}")
        result = probe.send_task("celery.ping")
        if result.get(timeout=max(5.0, deadline - time.monotonic())) != "pong":
            raise RuntimeError("celery.ping did not return 'pong'")
    finally:
        probe.close()


def _run_pytest(env: dict[str, str], args: list[str], pytest_log: Path, hard_timeout: float) -> int:
    """pytest in its own process group, its output shown and kept."""
    with open(pytest_log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=suite_dir(), env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + hard_timeout
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                sys.stdout.write(line)
                sys.stdout.flush()
                out.write(line)
                if time.monotonic() > deadline:
                    log(f"pytest overran {hard_timeout:.0f} s: killing it")
                    break
            try:
                return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return -1
        finally:
            _kill_group(proc, grace=5)


def run_name(pool: str, backend: str) -> str:
    """``prefork``, ``pulse`` (Redis backend); ``prefork-pulse-backend``, ``pulse-pulse-backend``."""
    return pool if backend == "redis" else f"{pool}-{backend}-backend"


def run_suite(pool: str, modules: Sequence[str], *, timeout: float, budget: float,
              only: Sequence[str] | None = None, junit: Path | None = None,
              label: str = "", backend: str = "redis") -> RunResult:
    """Start one worker, run pytest on ``modules`` (or the ``only`` ids of them), stop the worker.

    ``backend``: ``redis`` (``redis://127.0.0.1:6379/9``, or CELERY_SUITE_BACKEND) or ``pulse``
    (``pulse+<the run's private store URL>``, for the worker and the test process alike).
    """
    if pool not in ("prefork", "pulse"):
        raise ValueError(f"pool must be prefork or pulse, not {pool!r}")
    if backend not in ("redis", "pulse"):
        raise ValueError(f"backend must be redis or pulse, not {backend!r}")
    root = fetch()
    run_id = f"{time.strftime('%Y%m%d%H%M%S')}_{secrets.token_hex(3)}"
    tag = f"{run_name(pool, backend)}{'-' + label if label else ''}"
    logs = CACHE_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    worker_log = logs / f"{run_id}-{tag}-worker.log"
    pytest_log = logs / f"{run_id}-{tag}-pytest.log"
    outcomes_file = logs / f"{run_id}-{tag}-outcomes.json"
    nodename = f"celery-suite-{run_id}@{socket.gethostname()}"
    needs_store = pool == "pulse" or backend == "pulse"
    targets = [f"t/integration/{m}" for m in modules]
    for target in targets:
        if not (root / target).exists():
            raise SystemExit(f"no such module: {root / target}")

    started = time.monotonic()
    with private_vhost(run_id) as broker, (private_store(run_id) if needs_store
                                           else _no_store()) as store:
        backend_url = (f"pulse+{store}" if backend == "pulse"
                       else os.environ.get("CELERY_SUITE_BACKEND", f"{REDIS_URL}/9"))
        env = _env(broker, backend_url, store, nodename)
        if needs_store:
            migrate = _run([sys.executable, "-m", "celery", "-A", "celery_suite.app", "pulse", "migrate"],
                           env=env, cwd=PROJECT_DIR)
            if migrate.returncode != 0:
                raise RuntimeError(f"pulse migrate failed:\n{migrate.stdout}{migrate.stderr}")
        worker_cmd = [sys.executable, "-m", "celery", "-A", "celery_suite.app", "worker", "-P", pool,
                      "-c", "4", "-l", "info", "-n", nodename]
        log(f"worker: {' '.join(worker_cmd[2:])}, result_backend {backend_url} (log: {worker_log})")
        with open(worker_log, "wb") as wlog:
            worker = subprocess.Popen(worker_cmd, cwd=PROJECT_DIR, env=env, stdin=subprocess.DEVNULL,
                                      stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(worker, broker, backend_url, nodename, worker_log)
            log(f"worker ready after {time.monotonic() - started:.1f} s; running pytest on "
                f"{' '.join(modules)}{f' ({len(only)} selected ids)' if only is not None else ''}")
            env.update({
                "CELERY_SUITE_WORKER_PID": str(worker.pid),
                "CELERY_SUITE_DEADLINE": str(time.time() + budget),
                "CELERY_SUITE_TIMEOUT": str(timeout),
                "CELERY_SUITE_OUTCOMES": str(outcomes_file),
            })
            if only is not None:
                only_file = logs / f"{run_id}-{tag}-only.txt"
                only_file.write_text("".join(f"{i}\n" for i in only))
                env["CELERY_SUITE_ONLY"] = str(only_file)
            # celery.contrib.pytest has no entry point (pytest-celery would bring one): load it.
            # -p no:celery: pytest-celery (a dev dependency) must not replace Celery's own
            # fixtures: the suite runs exactly as Celery's CI runs it on prefork.
            args = ["-p", "no:celery", "-p", "celery.contrib.pytest", "-p", "celery_suite.pytest_plugin",
                    "-p", "no:cacheprovider",
                    "-c", str(root / "pytest.ini"), "--rootdir", str(root), f"--timeout={timeout:g}",
                    "-v", "-rfE", "--tb=short", "-o", "console_output_style=count"]
            if junit is not None:
                args.append(f"--junit-xml={junit}")
            _run_pytest(env, [*args, *targets], pytest_log, hard_timeout=budget + 2 * timeout + 120)
        finally:
            _kill_group(worker, grace=WORKER_STOP_GRACE)
    wall = time.monotonic() - started
    return _result(pool, backend, outcomes_file, wall, worker_log, pytest_log)


@contextmanager
def _no_store() -> Iterator[str]:
    """prefork on the Redis backend never opens pulse's store; the app still needs a URL."""
    yield f"sqlite:///{CACHE_DIR}/unused-pulse-store.sqlite3"


def _result(pool: str, backend: str, outcomes_file: Path, wall: float, worker_log: Path,
            pytest_log: Path) -> RunResult:
    if not outcomes_file.exists():
        raise RuntimeError(f"pytest wrote no outcomes (crashed at start?); see {pytest_log}")
    data = json.loads(outcomes_file.read_text())
    result = RunResult(pool=pool, backend=backend, collected=data["collected"], outcomes=data["outcomes"],
                       messages=data["messages"], durations=data["durations"], stopped=data["stopped"],
                       wall=wall, worker_log=worker_log, pytest_log=pytest_log)
    for test_id, seconds in result.durations.items():
        module = test_id.split("::", 1)[0].rsplit("/", 1)[-1]
        result.module_wall[module] = result.module_wall.get(module, 0.0) + seconds
    return result


def write_lists(result: RunResult, out_dir: Path, stem: str) -> tuple[Path, Path]:
    """The plain-text lists ``run`` promises: passed ids and not-passed ids, sorted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    passed = out_dir / f"{stem}-passed.txt"
    failed = out_dir / f"{stem}-failed.txt"
    passed.write_text("".join(f"{i}\n" for i in result.passed))
    failed.write_text("".join(f"{i}\n" for i in result.not_passed))
    return passed, failed


def summary(result: RunResult) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts().items()))
    modules = ", ".join(f"{m} {s:.0f} s" for m, s in sorted(result.module_wall.items()))
    stopped = f"; stopped early: {result.stopped}" if result.stopped else ""
    return (f"{run_name(result.pool, result.backend)} (celery {celery_version()}): "
            f"{len(result.collected)} collected: {counts}; "
            f"wall {result.wall:.0f} s (tests: {modules}){stopped}")
