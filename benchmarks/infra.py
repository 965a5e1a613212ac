"""What every benchmark needs: processes (always killed), stores, brokers, /proc readings."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_pulse import testing
from tests.helpers import mariadb, pg

ROOT = Path(__file__).resolve().parents[1]
PG_HOST_URL = os.environ.get("PULSE_BENCH_PG", "postgresql+psycopg://root@127.0.0.1:5432")
BENCH_DB = os.environ.get("PULSE_BENCH_DB", "pulse_bench")
#: The shared MariaDB server (any database on it): each run makes a database of its own.
MARIADB_URL = os.environ.get("PULSE_BENCH_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
RABBIT_URL = os.environ.get("PULSE_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
#: A database of its own on the shared Redis, so nobody else's keys get in the way.
REDIS_URL = os.environ.get("PULSE_BENCH_REDIS", "redis://127.0.0.1:6379/7")
BROKERS = {"rabbitmq": RABBIT_URL, "redis": REDIS_URL}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Disturbed(RuntimeError):
    """Something outside the benchmark interfered with a measurement (e.g. the shared
    broker force-closed our connections): the measurement is repeated, not reported."""


#: Worker log lines that mean the broker dropped the connection during a measurement.
DISTURBANCE = ("Connection to broker lost", "CONNECTION_FORCED")


def retrying(fn: Callable[[], Any], what: str, attempts: int = 3) -> tuple[Any, int]:
    """``fn()``, repeated (up to ``attempts`` times) while it raises :class:`Disturbed`.

    Returns (result, number of disturbed attempts thrown away).
    """
    for attempt in range(attempts):
        try:
            return fn(), attempt
        except Disturbed as exc:
            kill_all()
            if attempt == attempts - 1:
                raise
            log(f"{what}: disturbed from outside ({exc}); measuring again")
    raise AssertionError("unreachable")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.02) -> Any:
    """The test suite's poll, raising TimeoutError (the runner's retries rely on it)."""
    return testing.wait_for(predicate, timeout, what, interval, error=TimeoutError)


# -- processes -------------------------------------------------------------------------------
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def spawn(argv: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session (its own process group), output to ``log_path``."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _LIVE[proc.pid] = proc
    return proc


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal the process group of ``proc`` (a session leader we started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, sig)


def reap(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGKILL the whole group of ``proc`` and wait for it."""
    kill_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    # Children of a SIGKILLed parent may linger a moment in the same group.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not group_pids(proc.pid), 5, "the process group to be gone", 0.05)
    _LIVE.pop(proc.pid, None)


def kill_all() -> None:
    """Kill every process group this runner started and has not reaped (on exit/errors)."""
    for proc in list(_LIVE.values()):
        reap(proc, timeout=5)


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """``(pid, fields after the command name)`` of every process in /proc/*/stat."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        yield int(stat.split("/")[2]), fields


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    return [pid for pid, fields in _proc_stats() if fields[0] != "Z" and int(fields[2]) == pgid]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def memory(pids: list[int]) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in bytes over ``pids`` (PSS splits shared pages fairly)."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU time of each of ``pids`` (seconds), all its threads included.

    From ``/proc/<pid>/task/*/schedstat`` (nanoseconds): ``utime``/``stime`` in
    ``/proc/<pid>/stat`` count whole clock ticks (10 ms), which rounds the many short
    bits of work of many processes (database backends) down to nothing.
    Falls back to ``stat`` where schedstat is missing.
    """
    out = {}
    for pid in pids:
        total = 0.0
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
                    total += int(fh.read().split()[0]) / 1e9
            out[pid] = total
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def process_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time of the whole process ``pid``: every thread, those that ended included.

    From ``utime + stime`` of ``/proc/<pid>/stat`` (clock ticks, 10 ms): for one
    long-lived multi-threaded server (mariadbd), where a connection's thread may end
    between two readings and take its schedstat with it. ``{}`` if ``pid`` is gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return {}
    return {pid: (int(fields[11]) + int(fields[12])) / CLK_TCK}


def children_of(ppid: int) -> list[int]:
    return [pid for pid, fields in _proc_stats() if int(fields[1]) == ppid]


# -- a run's scratch space and worker processes ------------------------------------------------
class Scratch:
    """A temporary directory for one benchmark run: logs, journals, SQLite files."""

    def __init__(self, keep: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pulse-bench-"))
        self.keep = keep

    def path(self, name: str) -> Path:
        return self.dir / f"{name}-{uuid.uuid4().hex[:8]}"

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def app_env(broker: str, queue: str, store: str | None = None,
            conf: dict[str, Any] | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("BENCH_")]:
        del env[key]
    env.update(BENCH_BROKER=broker, BENCH_QUEUE=queue, BENCH_CONF=json.dumps(conf or {}),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    if store:
        env["BENCH_STORE"] = store
    env.update(extra)
    return env


class Process:
    """One process we started, in its own process group (always killed in the end)."""

    def __init__(self, scratch: Scratch, name: str, argv: list[str],
                 environ: dict[str, str]) -> None:
        self.name = name
        self.log_path = scratch.path(f"worker-{name}").with_suffix(".log")
        self.started = time.time()
        self.proc = spawn(argv, environ, self.log_path, scratch.dir)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def pids(self) -> list[int]:
        return group_pids(self.proc.pid)

    def check_undisturbed(self) -> None:
        """Raise :class:`Disturbed` if the broker dropped this worker's connection."""
        text = self.log()
        for marker in DISTURBANCE:
            if marker in text:
                raise Disturbed(f"worker {self.name}: {marker!r} in its log")

    def check_alive(self) -> bool:
        """Raise if the worker has exited; otherwise False (so it chains after ``or``)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}):\n"
                               f"{self.log()[-3000:]}")
        return False

    def terminate(self, timeout: float = 15) -> int | None:
        """Warm shutdown (SIGTERM to the main process), then SIGKILL whatever is left."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        code = self.proc.poll()
        reap(self.proc)
        return code

    def kill(self) -> None:
        reap(self.proc)


class Worker(Process):
    """One ``celery -A benchmarks.apps worker``."""

    def __init__(self, scratch: Scratch, name: str, *, pool: str, concurrency: int, broker: str,
                 queue: str, store: str | None = None, conf: dict[str, Any] | None = None,
                 loglevel: str = "warning", extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.ready_file = scratch.path(f"ready-{name}")
        argv = [sys.executable, "-m", "celery", "-A", "benchmarks.apps", "worker", "-P", pool,
                "-c", str(concurrency), "-n", f"{name}@bench", "-Q", queue, "-l", loglevel,
                "--without-mingle", "--without-gossip", "--without-heartbeat", *extra]
        environ = app_env(broker, queue, store, conf, BENCH_READY_FILE=str(self.ready_file),
                          **(env or {}))
        super().__init__(scratch, name, argv, environ)

    def ready_at(self) -> float | None:
        try:
            text = self.ready_file.read_text().split()
        except OSError:
            return None
        return float(text[-1]) if len(text) >= 3 else None

    def wait_ready(self, timeout: float = 60) -> float:
        def ready() -> float | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}) before "
                                   f"ready:\n{self.log()[-3000:]}")
            return self.ready_at()
        value: float = wait_for(ready, timeout, f"worker {self.name} to be ready", 0.01)
        return value



@contextlib.contextmanager
def workers() -> Iterator[list[Any]]:
    """A list the caller appends processes to; every one is killed on the way out."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for w in started:
            w.kill()


def celery_cli(broker: str, queue: str, *args: str, store: str | None = None,
               conf: dict[str, Any] | None = None, timeout: float = 60) -> str:
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "benchmarks.apps", *args],
                          env=app_env(broker, queue, store, conf), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"celery {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


# -- stores ------------------------------------------------------------------------------------
def pg_url(database: str, base: str = PG_HOST_URL) -> str:
    return f"{base}/{database}"


def ensure_bench_database() -> str:
    """The dedicated benchmark database on the shared server (created once)."""
    engine = sa.create_engine(pg_url("postgres"), isolation_level="AUTOCOMMIT",
                              poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            exists = conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :d"),
                                  {"d": BENCH_DB}).first()
            if exists is None:
                conn.exec_driver_sql(f'CREATE DATABASE "{BENCH_DB}"')
    finally:
        engine.dispose()
    return pg_url(BENCH_DB)


def migrate(url: str) -> None:
    from celery_pulse.store.sql import open_store

    store = open_store(url, check_schema=False)
    try:
        store.migrate()
    finally:
        store.close()


@contextlib.contextmanager
def fresh_pg_schema(database_url: str) -> Iterator[str]:
    """A new, migrated schema in ``database_url``; dropped afterwards."""
    name = "b_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(database_url, isolation_level="AUTOCOMMIT",
                              poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
    url = pg.schema_url(database_url, name)
    try:
        migrate(url)
        yield url
    finally:
        with contextlib.suppress(Exception), engine.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        engine.dispose()


@contextlib.contextmanager
def fresh_sqlite(scratch: Scratch) -> Iterator[str]:
    path = scratch.path("store").with_suffix(".sqlite3")
    url = f"sqlite:///{path}"
    migrate(url)
    try:
        yield url
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.unlink(f"{path}{suffix}")


@contextlib.contextmanager
def fresh_mariadb(base_url: str = MARIADB_URL) -> Iterator[str]:
    """A new, migrated database on the MariaDB server of ``base_url``; dropped afterwards.

    MariaDB has no schemas inside a database (a schema *is* a database), so where
    PostgreSQL runs get a schema, these get a database, with a binary collation (strings
    compare byte for byte, as on PostgreSQL and SQLite).
    """
    name = "b_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(base_url, isolation_level="AUTOCOMMIT",
                              poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        conn.exec_driver_sql(
            f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    url = sa.make_url(base_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate(url)
        yield url
    finally:
        with contextlib.suppress(Exception), engine.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        engine.dispose()


@contextlib.contextmanager
def fresh_store(kind: str, scratch: Scratch, database_url: str,
                mariadb_url: str = MARIADB_URL) -> Iterator[str]:
    """A fresh store of ``kind``: a schema in the PostgreSQL ``database_url``, a database
    on the MariaDB server of ``mariadb_url`` (its driver too), or a SQLite file in
    ``scratch``."""
    if kind == "postgres":
        with fresh_pg_schema(database_url) as url:
            yield url
    elif kind == "mariadb":
        with fresh_mariadb(mariadb_url) as url:
            yield url
    elif kind == "sqlite":
        with fresh_sqlite(scratch) as url:
            yield url
    else:
        raise ValueError(f"unknown store kind {kind!r}")


#: Process names of a MariaDB/MySQL server.
MARIADB_NAMES = ("mariadbd", "mysqld")


def mariadb_server_pid(url: str = MARIADB_URL) -> int | None:
    """The pid of the local ``mariadbd`` serving ``url`` (None if it is not on this host).

    The server names its pid file (``@@pid_file``); other MariaDB servers on this host
    (the test suite starts private ones) have pid files of their own. When that file
    cannot be read, the one ``mariadbd``/``mysqld`` process listening on the URL's port.
    """
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            pid_file, port = conn.execute(sa.text("SELECT @@pid_file, @@port")).one()
    finally:
        engine.dispose()
    servers = {pid: _cmdline(pid) for pid, _ in _proc_stats() if _comm(pid) in MARIADB_NAMES}
    with contextlib.suppress(OSError, ValueError, TypeError):
        pid = int(Path(pid_file).read_text().split()[0])
        if pid in servers:
            return pid
    mine = [pid for pid, argv in servers.items()
            if f"--port={port}" in argv or (port == 3306 and not any(
                a.startswith("--port=") for a in argv))]
    return mine[0] if len(mine) == 1 else None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace").split("\0")
    except OSError:
        return []


class PrivatePostgres(pg.PrivatePostgres):
    """The test suite's private server, durable by default (fsync on, as in production),
    and measurable."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        super().__init__(dict(settings or {}))

    def cpu_seconds(self) -> dict[int, float]:
        """CPU seconds of the postmaster and every backend and helper it forked."""
        pid = self.postmaster_pid()
        return cpu_seconds([pid, *children_of(pid)])


class PrivateMariaDB(mariadb.PrivateMariaDB):
    """The test suite's private MariaDB, durable by default (the redo log flushed at
    every commit, as in production), plus the server ``settings`` given (``--name=value``)."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        super().__init__(dict(settings or {}))


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two :func:`cpu_seconds` readings (new processes count fully)."""
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


# -- brokers -----------------------------------------------------------------------------------
def client_app(broker: str, queue: str) -> Any:
    from celery import Celery

    app = Celery("bench-client", broker=broker, set_as_current=False)
    app.conf.task_default_queue = queue
    return app


def pulse_counts(broker: str, queue: str, worker: str) -> dict[str, int]:
    """The ``pulse`` counters of a running worker (``celery inspect stats``)."""
    app = client_app(broker, queue)
    try:
        replies = app.control.inspect(destination=[worker], timeout=5).stats() or {}
    finally:
        app.close()
    if worker not in replies:
        raise RuntimeError(f"worker {worker} did not answer inspect stats")
    return dict(replies[worker]["pulse"]["counts"])


def kombu_queue(name: str) -> Any:
    from kombu import Exchange, Queue

    return Queue(name, Exchange(name, "direct"), routing_key=name)


def declare_queue(broker: str, name: str) -> None:
    from kombu import Connection

    with Connection(broker) as conn:
        kombu_queue(name)(conn.default_channel).declare()


def delete_queue(broker: str, name: str) -> None:
    from kombu import Connection

    with contextlib.suppress(Exception), Connection(broker) as conn:
        kombu_queue(name)(conn.default_channel).delete()


def queue_depth(broker: str, name: str) -> int:
    from amqp.exceptions import ChannelError
    from kombu import Connection

    with Connection(broker) as conn:
        try:
            _, depth, _ = kombu_queue(name)(conn.default_channel).queue_declare(passive=True)
        except ChannelError as exc:  # Redis: an emptied queue's list key is gone
            if "404" not in str(exc):
                raise
            return 0
        return int(depth)


def publish(broker: str, queue: str, calls: list[tuple[str, list[Any]]],
            options: dict[str, Any] | None = None) -> list[str]:
    """Publish ``calls`` (task name, args) to ``queue`` over one producer; the task ids."""
    app = client_app(broker, queue)
    ids = []
    try:
        with app.producer_or_acquire() as producer:
            for name, args in calls:
                ids.append(app.send_task(name, args=args, queue=queue, producer=producer,
                                         **(options or {})).id)
    finally:
        app.close()
    return ids


def purge_redis_db(url: str = REDIS_URL) -> None:
    """Empty the benchmark's own Redis database (left-over queues, unacked, locks)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# -- machine ----------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import celery
    import kombu
    import psycopg

    info: dict[str, Any] = {
        "cores": os.cpu_count(), "python": platform.python_version(),
        "celery": celery.__version__, "kombu": kombu.__version__,
        "sqlalchemy": sa.__version__, "psycopg": psycopg.__version__,
        "platform": platform.platform(), "cpu": _cpu_model(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    with contextlib.suppress(Exception):
        engine = sa.create_engine(pg_url("postgres"), poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            info["postgresql"] = conn.exec_driver_sql("SHOW server_version").scalar_one()
        engine.dispose()
    with contextlib.suppress(Exception):
        engine = sa.create_engine(MARIADB_URL, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            info["mariadb"] = conn.exec_driver_sql("SELECT VERSION()").scalar_one()
        engine.dispose()
    with contextlib.suppress(Exception):
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        info["redis"] = client.info("server")["redis_version"]
        client.close()
    with contextlib.suppress(Exception):
        from kombu import Connection

        with Connection(RABBIT_URL) as conn:
            conn.connect()
            props = conn.connection.server_properties
            info["rabbitmq"] = props.get("version")
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["celery-redbeat"] = version("celery-redbeat")
        info["py-spy"] = version("py-spy")
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["pymysql"] = version("PyMySQL")
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()
