"""pytest-celery nodes over local processes and running services, no containers.

A :class:`PulseWorkerNode` is a ``celery worker -P pulse`` subprocess of the test;
broker and backend nodes point at kombu's ``filesystem://`` transport and a
``file://`` result backend in the test's own folder (nothing to run), or at a Redis or
RabbitMQ server that is already running. Every node leaves nothing behind: the
worker's process group is killed, the test's queue and exchange are deleted from
RabbitMQ, and the Redis database the nodes own is emptied.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import types
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import celery
from celery import Celery
from pytest_celery import CeleryTestBackend, CeleryTestBroker, CeleryTestWorker

from celery_pulse.contrib import services
from celery_pulse.contrib.pytest_celery.process import LocalProcess
from celery_pulse.contrib.pytest_celery.worker_app import SPEC_ENV


class PulseWorkerNode(CeleryTestWorker):
    """A ``celery worker -P pulse`` process of the test, in pytest-celery's worker role.

    ``kill()`` is a SIGKILL of the worker and its pool (a crash), ``kill("SIGTERM")``
    a warm shutdown, ``pause()``/``resume()`` freeze and thaw the whole process group
    (a stalled host), ``restart()`` stops it warmly and starts it again under the same
    name. ``logs()`` holds everything it printed, over every run.
    """

    container: LocalProcess

    def __init__(self, process: LocalProcess, app: Celery, *, worker_name: str, host: str,
                 queue: str, log_level: str) -> None:
        super().__init__(process, app)
        self._worker_name = worker_name
        self._host = host
        self._queue = queue
        self._log_level = log_level

    @property
    def version(self) -> str:
        return str(celery.__version__)

    @property
    def log_level(self) -> str:
        return self._log_level

    @property
    def worker_name(self) -> str:
        return self._worker_name

    @property
    def worker_queue(self) -> str:
        return self._queue

    def hostname(self) -> str:
        """The worker's node name (``name@host``), as Celery's events and inspect show it."""
        return f"{self._worker_name}@{self._host}"

    @property
    def pid(self) -> int | None:
        """The worker's main process (its pool processes are in its process group)."""
        return self.container.pid

    def ready(self) -> bool:
        return self.container.ready()

    def kill(self, signal: str | int = "SIGKILL", reload_container: bool = True) -> None:
        self.container.kill(signal)

    def pause(self) -> None:
        """SIGSTOP the worker and its pool: it renews nothing until :meth:`resume`."""
        self.container.kill("SIGSTOP")

    def resume(self) -> None:
        self.container.kill("SIGCONT")

    def restart(self, reload_container: bool = True, force: bool = False) -> None:
        """Stop the worker (warm shutdown; a forced kill with ``force``) and start it again."""
        if force:
            self.container.kill("SIGKILL")
        self.container.restart()
        self.container.ready()
        if self.app:
            self.app.set_current()

    def get_running_processes_info(self, columns: list[str] | None = None,
                                   filters: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """``pid``, ``name``, ``cmdline`` of the worker's processes (other columns: None)."""
        rows = self.container.processes()
        if columns:
            rows = [{column: row.get(column) for column in columns} for row in rows]
        if filters:
            rows = [row for row in rows if all(row.get(k) == v for k, v in filters.items())]
        return rows

    def teardown(self) -> None:
        self.container.teardown()


#: Packages whose module-level references to an app are not the app's home.
_NOT_HOMES = ("celery", "kombu", "billiard", "pytest_celery", "_pytest", "pytest", "celery_pulse")


def find_app_ref(app: Celery) -> str | None:
    """``module:attribute`` of a module-level app of the user's, so a worker imports the real thing.

    None for an app made on the fly (pytest-celery's setup app): the worker rebuilds it.
    """
    candidates = sorted(sys.modules.items(), key=lambda item: not item[0].startswith(app.main or "~"))
    for name, module in candidates:
        if (not isinstance(module, types.ModuleType) or name == "__main__"
                or name.split(".")[0] in _NOT_HOMES):
            continue
        for attr, value in list(vars(module).items()):
            if value is app:
                return f"{name}:{attr}"
    return None


def picklable_config(app: Celery, *, strict: bool) -> dict[str, Any]:
    """The app's configuration as the test has it (``config_from_object`` included).

    ``app.conf.changes`` no longer holds what ``config_from_object`` loaded once the
    configuration is read, hence ``table``; pickle, because timedelta and crontab
    settings are not JSON.
    """
    config: dict[str, Any] = {}
    for key, value in app.conf.table(with_defaults=False, censored=False).items():
        if key == "deprecated_settings":  # Celery's own bookkeeping, not a setting
            continue
        try:
            pickle.dumps(value)
        except Exception as exc:
            if strict:
                raise ValueError(f"setting {key!r} can't be handed to a worker process "
                                 f"(not picklable: {exc}); set it in an importable module "
                                 "and return that module's app from default_worker_app") from exc
            continue  # the worker imports the app's own module, which sets it
        config[key] = value
    return config


def module_names(modules: Iterable[types.ModuleType | str]) -> list[str]:
    return [m if isinstance(m, str) else m.__name__ for m in modules]


def python_path() -> str:
    """The test process's import path, so the worker imports the same task modules."""
    entries = [p for p in sys.path if p and os.path.isdir(p)]
    extra = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*entries, *([extra] if extra else [])])


def start_worker(app: Celery, *, folder: Path, queue: str, worker_name: str,
                 overrides: dict[str, Any] | None = None,
                 modules: Sequence[types.ModuleType | str] = (), concurrency: int = 1,
                 log_level: str = "INFO", extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, ready_timeout: float = 60.0) -> PulseWorkerNode:
    """Migrate the store, start ``celery worker -P pulse`` for ``app`` and wait until ready.

    The worker runs ``app`` (imported from its module when it is a module-level app,
    else rebuilt from its configuration) with ``overrides`` (the test's broker,
    backend, store, queue ...) applied over its own settings.
    """
    from celery_pulse.testing import migrate

    overrides = dict(overrides or {})
    migrate(str(overrides.get("pulse_store_url") or app.conf.pulse_store_url))
    folder.mkdir(parents=True, exist_ok=True)
    app_ref = find_app_ref(app)
    config = picklable_config(app, strict=app_ref is None)
    config.update(overrides)
    spec = {"main": app.main, "app_ref": app_ref, "modules": module_names(modules),
            "config": config}
    spec_path = folder / f"{worker_name}.spec"
    spec_path.write_bytes(pickle.dumps(spec))
    host = socket.gethostname()
    argv = [sys.executable, "-m", "celery", "-A", "celery_pulse.contrib.pytest_celery.worker_app",
            "worker", "-P", "pulse", "-n", f"{worker_name}@{host}", "-c", str(concurrency),
            "-Q", queue, "-l", log_level, "--without-mingle", "--without-gossip", *extra_args]
    variables = dict(os.environ)
    variables.update(env or {})
    variables.update({SPEC_ENV: str(spec_path), "PYTHONPATH": python_path(),
                      "PYTHONUNBUFFERED": "1"})
    process = LocalProcess(worker_name, argv, env=variables, cwd=folder, ready_prompt="ready.")
    node = PulseWorkerNode(process, app, worker_name=worker_name, host=host, queue=queue,
                           log_level=log_level)
    process.start()
    try:
        process.ready(ready_timeout)
    except BaseException:
        process.teardown()
        raise
    return node


class RunningService:
    """A service the test uses but does not own, in the container's role.

    It can't be killed or restarted by a test (other tests share it); its
    ``celeryconfig`` gives the URL and any extra settings, and ``teardown`` tidies
    what the test left on it.
    """

    status = "running"

    def __init__(self, name: str, url: str, conf: dict[str, Any] | None = None,
                 tidy: Any = None) -> None:
        self.name = name
        self.id = uuid.uuid4().hex
        self.celeryconfig: dict[str, Any] = {"url": url, "host_url": url, "conf": dict(conf or {})}
        self._tidy = tidy

    def logs(self) -> str:
        return ""

    def ready(self) -> bool:
        return True

    def reload(self) -> None:
        """Nothing to refresh."""

    def kill(self, signal: str | int = "SIGKILL") -> None:
        raise NotImplementedError(f"{self.name} is a shared service: a test can't kill it")

    def restart(self, timeout: float | None = None) -> None:
        raise NotImplementedError(f"{self.name} is a shared service: a test can't restart it")

    def teardown(self) -> None:
        if self._tidy is not None:
            tidy, self._tidy = self._tidy, None
            tidy()


class _ServiceNode:
    """Settings of a broker/backend node beyond its URL (transport options ...)."""

    container: RunningService

    def celery_conf(self) -> dict[str, Any]:
        return dict(self.container.celeryconfig["conf"])


class PulseTestBroker(_ServiceNode, CeleryTestBroker):
    """A broker node over a running service (or kombu's ``filesystem://`` folders)."""


class PulseTestBackend(_ServiceNode, CeleryTestBackend):
    """A result backend node over a running service (or a ``file://`` folder)."""


def filesystem_broker(folder: Path) -> PulseTestBroker:
    """kombu's ``filesystem://`` transport in ``folder``: no server, fanout included."""
    for sub in ("in", "processed", "control"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    options = {"data_folder_in": str(folder / "in"), "data_folder_out": str(folder / "in"),
               "processed_folder": str(folder / "processed"),
               "control_folder": str(folder / "control"), "store_processed": False,
               "polling_interval": 0.05}
    service = RunningService("filesystem-broker", "filesystem://",
                             {"broker_transport_options": options})
    return PulseTestBroker(service)


def redis_broker(url: str) -> PulseTestBroker:
    """The Redis server at ``url``; its database is emptied when the test ends."""
    service = RunningService("redis-broker", url, tidy=lambda: services.flush_redis_db(url))
    return PulseTestBroker(service)


def rabbitmq_broker(url: str, queue: str) -> PulseTestBroker:
    """The RabbitMQ server at ``url``; the test's queue and exchange are deleted at the end."""
    service = RunningService("rabbitmq-broker", url,
                             tidy=lambda: services.delete_amqp_entities(url, [queue], [queue]))
    return PulseTestBroker(service)


def file_backend(folder: Path) -> PulseTestBackend:
    """Celery's ``file://`` result backend in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    return PulseTestBackend(RunningService("file-backend", f"file://{folder}"))


def redis_backend(url: str) -> PulseTestBackend:
    """The Redis result backend at ``url``; its database is emptied when the test ends."""
    service = RunningService("redis-backend", url, tidy=lambda: services.flush_redis_db(url))
    return PulseTestBackend(service)
