"""Smoke test of the published extras: one real ``celery worker -P pulse`` per broker.

A plain script, not pytest: it runs in a venv that holds only ``pip install ".[postgres,redis]"``
(what a user installs), so it imports nothing but the stdlib, celery, kombu, SQLAlchemy and
the installed celery_pulse. A
runtime dependency that a broker's transport needs but the extras do not pull in shows up as
that broker failing here, the way it would for a user.

For each broker: a fresh PostgreSQL schema for the store, ``celery pulse migrate``, a worker on
a queue of its own, a few ``pulseapp.touch`` tasks, then the files they create and their claim
rows (``succeeded``) are checked. The worker's process group is always killed and the schema
dropped. Ends with ``N passed, M failed``; exits non-zero if anything failed.

Usage: ``python tests/smoke/extras_smoke.py [--app MODULE] [--broker amqp|redis ...]``, with
``MODULE`` (default ``tests.apps.pulseapp``) importable through ``PYTHONPATH`` (default: the
repository root).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import sqlalchemy as sa
from celery import Celery

from celery_pulse import testing

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
BROKERS = {
    "amqp": ("RabbitMQ", "amqp://guest:guest@127.0.0.1:5672//"),
    "redis": ("Redis", "redis://127.0.0.1:6379/0"),
}
PG_ADMIN = "postgresql+psycopg://root@127.0.0.1:5432/test"
TASKS = 3
LOG_TAIL = 60


class SmokeFailure(Exception):
    """A check failed; the message says which, ``detail`` holds the log lines that show why."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    """The installed package's poll-with-a-deadline, failing as a smoke failure."""
    return testing.wait_for(predicate, timeout, what, interval=0.1, error=SmokeFailure)


def schema_url(base: str, schema: str) -> str:
    """``base`` with every connection's search_path set to ``schema`` (as tests/helpers/pg.py)."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-csearch_path={schema}')}"


@contextlib.contextmanager
def fresh_schema(admin_url: str) -> Iterator[str]:
    """A throwaway schema in the shared database, dropped on the way out whatever happened."""
    name = "smoke_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
        try:
            yield name
        finally:
            with engine.connect() as conn:
                conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    finally:
        engine.dispose()


class Worker:
    """A ``celery worker -P pulse`` in its own session, so the whole group can be killed."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.log_path = cwd / "worker.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill()
        self._killed = False
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ready(self) -> bool:
        """True once the worker logged "ready."; fails fast if it died before that."""
        if "ready." in self.log():
            return True
        if self.proc.poll() is not None:
            raise SmokeFailure(f"worker exited with {self.proc.returncode} before it was ready")
        return False

    def kill(self) -> None:
        """SIGKILL the process group: the worker and its pool children, nothing left behind."""
        if self._killed:
            return
        self._killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


def child_env(broker_url: str, store_url: str, queue: str) -> dict[str, str]:
    """The variables tests/apps/pulseapp.py reads, plus a PYTHONPATH that finds the app."""
    env = dict(os.environ)
    env.update(PULSE_TEST_BROKER=broker_url, PULSE_TEST_STORE=store_url, PULSE_TEST_QUEUE=queue,
               PULSE_TEST_CONF=json.dumps({}), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.environ.get("PYTHONPATH") or str(ROOT))
    return env


def claim_states(store_url: str, task_ids: list[str]) -> dict[str, str]:
    """``task_id -> state`` of the claim rows the worker wrote for our tasks."""
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT task_id, state FROM pulse_claims WHERE task_id IN :ids")
                                .bindparams(sa.bindparam("ids", expanding=True)), {"ids": task_ids})
            return {str(r.task_id): str(r.state) for r in rows}
    finally:
        engine.dispose()


def delete_queue(producer: Celery, queue: str) -> None:
    """Best effort: the unique queue (and on Redis its binding keys) would outlive every run.

    Declared first, as the worker declared it, so that this channel knows the binding and
    kombu's Redis transport removes it along with the queue.
    """
    with contextlib.suppress(Exception), producer.connection_for_write() as conn:
        bound = producer.amqp.queues[queue].bind(conn.default_channel)
        bound.declare()
        bound.delete()


def smoke_broker(key: str, app: str, admin_url: str, timeout: float) -> str:
    """Run one broker end to end; return a one-line summary or raise SmokeFailure."""
    _, broker_url = BROKERS[key]
    queue = f"pulse-smoke-{key}-{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix=f"pulse-smoke-{key}-"))
    started = time.monotonic()
    worker: Worker | None = None
    producer = Celery("extras-smoke", broker=broker_url)
    producer.conf.task_default_queue = queue  # the same queue definition as the worker's
    try:
        with fresh_schema(admin_url) as schema:
            store_url = schema_url(admin_url, schema)
            env = child_env(broker_url, store_url, queue)
            celery = [sys.executable, "-m", "celery", "-A", app]
            migrate = subprocess.run([*celery, "pulse", "migrate"], env=env, cwd=tmp,
                                     stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                     timeout=timeout)
            if migrate.returncode != 0:
                tail = "\n".join((migrate.stdout + migrate.stderr).splitlines()[-LOG_TAIL:])
                raise SmokeFailure(f"pulse migrate exited with {migrate.returncode}", tail)
            worker = Worker([*celery, "worker", "-P", "pulse", "-c", "2", "-Q", queue,
                             "-n", f"{queue}@%h", "-l", "info", "--without-mingle",
                             "--without-gossip"], env, tmp)
            try:
                wait_for(worker.ready, timeout, 'the worker to log "ready."')
                paths = [tmp / f"touched-{i}" for i in range(TASKS)]
                task_ids = [producer.send_task("pulseapp.touch", args=[str(p), key], queue=queue).id
                            for p in paths]
                wait_for(lambda: all(p.exists() for p in paths), timeout, f"{TASKS} files")
                states: dict[str, str] = {}

                def all_succeeded() -> bool:
                    states.update(claim_states(store_url, task_ids))
                    return len(states) == TASKS and set(states.values()) == {"succeeded"}

                try:
                    wait_for(all_succeeded, timeout, "the claims to end succeeded")
                except SmokeFailure as exc:
                    raise SmokeFailure(f"{exc}; claim states: {states}") from None
            except Exception as exc:
                worker.kill()
                tail = "\n".join(worker.log().splitlines()[-LOG_TAIL:])
                reason = str(exc) if isinstance(exc, SmokeFailure) else f"{type(exc).__name__}: {exc}"
                raise SmokeFailure(reason, f"last {LOG_TAIL} lines of the worker log:\n{tail}") from exc
            finally:
                worker.kill()
    finally:
        delete_queue(producer, queue)
        producer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return f"{TASKS} tasks succeeded in {time.monotonic() - started:.1f}s"


def main(argv: list[str] | None = None) -> int:
    """Smoke every requested broker; the closing line is what CI reads."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--app", default=os.environ.get("PULSE_SMOKE_APP", "tests.apps.pulseapp"),
                        help="the Celery app module the worker runs (-A)")
    parser.add_argument("--broker", action="append", choices=sorted(BROKERS),
                        help="broker to smoke (repeatable; default: all)")
    parser.add_argument("--pg", default=PG_ADMIN, help="admin URL of the store's database")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for each wait")
    args = parser.parse_args(argv)

    spec = importlib.util.find_spec("celery_pulse")
    print(f"celery_pulse from {spec.origin if spec else 'NOT FOUND'}; app {args.app}", flush=True)
    passed = failed = 0
    for key in args.broker or list(BROKERS):
        name, url = BROKERS[key]
        label = f"{name} ({url.replace('guest:guest@', 'guest:***@')})"
        try:
            summary = smoke_broker(key, args.app, args.pg, args.timeout)
        except Exception as exc:
            failed += 1
            reason = str(exc) if isinstance(exc, SmokeFailure) else f"{type(exc).__name__}: {exc}"
            print(f"FAIL {label}: {reason}", flush=True)
            detail = getattr(exc, "detail", "")
            if detail:
                print("    " + detail.replace("\n", "\n    "), flush=True)
        else:
            passed += 1
            print(f"PASS {label}: {summary}", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
