"""Real ``celery worker`` processes, started and always killed by a fixture."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery_pulse.testing import wait_for

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "Env", "Worker", "assert_alive", "wait_alive", "wait_for"]




class Env:
    """The environment shared by the workers and CLI calls of one test."""

    def __init__(self, store_url: str, broker_url: str, queue: str, tmp: Path,
                 conf: dict[str, Any] | None = None, app: str = "tests.apps.pulseapp") -> None:
        self.store_url = store_url
        self.broker_url = broker_url
        self.queue = queue
        self.tmp = tmp
        self.conf = dict(conf or {})
        self.app = app

    def vars(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(PULSE_TEST_STORE=self.store_url, PULSE_TEST_BROKER=self.broker_url,
                   PULSE_TEST_QUEUE=self.queue, PULSE_TEST_CONF=json.dumps(self.conf),
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                   PYTHONUNBUFFERED="1")
        return env

    def celery(self, *args: str, check: bool = False, timeout: float = 60
               ) -> subprocess.CompletedProcess[str]:
        """Run ``celery -A app ARGS`` (a CLI command, not a worker) and capture output."""
        return subprocess.run([sys.executable, "-m", "celery", "-A", self.app, *args],
                              env=self.vars(), cwd=self.tmp, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def celery_json(self, *args: str) -> Any:
        proc = self.celery(*args, "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


class Worker:
    """One ``celery worker`` process in its own process group."""

    def __init__(self, env: Env, name: str, *, pool: str = "pulse", concurrency: int = 1,
                 extra: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> None:
        self.env = env
        self.name = name
        self.log_path = env.tmp / f"worker-{name.replace('@', '_')}-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-m", "celery", "-A", env.app, "worker", "-P", pool,
                "-n", name, "-c", str(concurrency), "-Q", env.queue, "-l", "info",
                "--without-mingle", "--without-gossip", *extra]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill()/wait()
        variables = env.vars()
        variables.update(extra_env or {})
        self.proc = subprocess.Popen(argv, env=variables, cwd=env.tmp, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            if self.proc.poll() is not None and not re.search(pattern, self.log()):
                raise AssertionError(f"worker {self.name} exited ({self.proc.returncode}) "
                                     f"before logging {pattern!r}:\n{self.log()[-3000:]}")
            return re.search(pattern, self.log())
        try:
            result: re.Match[str] = wait_for(found, timeout, f"{self.name} to log {pattern!r}")
        except AssertionError as exc:  # the log's tail says why: keep it in the report
            raise AssertionError(f"{exc}; the worker's log ends:\n{self.log()[-4000:]}"
                                 ) from None
        return result

    def wait_ready(self, timeout: float = 30) -> Worker:
        self.wait_log(r"ready\.", timeout)
        return self

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def signal_main(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.name} still running after {timeout}s:\n"
                                 f"{self.log()[-3000:]}") from None

    def kill(self) -> None:
        """SIGKILL the whole process group (the worker and its pool children)."""
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


def assert_alive(*ws: Worker) -> None:
    """Fail at once, with its log, if one of ``ws`` exited."""
    for w in ws:
        if w.proc.poll() is not None:
            raise AssertionError(f"worker {w.name} exited ({w.proc.returncode}):\n"
                                 f"{w.log()[-4000:]}")


def wait_alive(predicate: Callable[[], Any], timeout: float, what: str,
               ws: tuple[Worker, ...], interval: float = 0.05) -> Any:
    """``wait_for`` while the workers ``ws`` live: it fails at once if one died, and shows
    the workers' logs."""
    def check() -> Any:
        assert_alive(*ws)
        return predicate()
    try:
        return wait_for(check, timeout, what, interval=interval)
    except AssertionError as exc:
        tails = "\n".join(f"--- {w.name}:\n{w.log()[-3000:]}" for w in ws)
        raise AssertionError(f"{exc}\n{tails}") from None


def stop_consuming(app: Any, worker: str, queue: str, timeout: float = 10.0) -> None:
    """Make ``worker`` stop consuming ``queue``; return once it has.

    Celery's ``cancel_consumer`` answers before the worker's loop runs the cancel (it is
    deferred with ``call_soon``): a worker paused right after the answer still consumes,
    and the broker hands it the next delivery. ``active_queues`` lists the queue until
    the cancel has run, so the wait polls it.
    """
    replies = app.control.cancel_consumer(queue, destination=[worker], reply=True,
                                          timeout=timeout)
    assert replies and worker in replies[0], replies

    def gone() -> bool:
        answer = app.control.inspect(destination=[worker], timeout=1.0).active_queues() or {}
        queues = answer.get(worker)
        return queues is not None and all(q["name"] != queue for q in queues)
    wait_for(gone, timeout, f"{worker} to stop consuming {queue}", interval=0.1)
