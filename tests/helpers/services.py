"""Service availability: fail in CI (CI=true), skip with a message locally."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from celery_pulse.contrib import services as plugin_services
from celery_pulse.contrib.services import IN_CI, reachable

__all__ = ["IN_CI", "MARIADB_ADMIN_URL", "PG_ADMIN_URL", "RABBIT_URL", "REDIS_URL",
           "SCHEMA_PREFIX", "SERVICES", "XDIST_WORKER", "cut_vhost_connections",
           "drop_process_vhost", "make_process_vhost", "private_vhost", "reachable", "require",
           "require_module", "tidy_queue", "vhost_of"]

SERVICES = {
    "postgres": ("127.0.0.1", 5432),
    "mariadb": plugin_services.address(plugin_services.MARIADB_URL, 3306),  # $PULSE_TEST_MARIADB
    "rabbitmq": ("127.0.0.1", 5672),
    "redis": ("127.0.0.1", 6379),
}

PG_ADMIN_URL = plugin_services.POSTGRES_URL  # $PULSE_TEST_PG
MARIADB_ADMIN_URL = plugin_services.MARIADB_URL  # $PULSE_TEST_MARIADB

#: pytest-xdist's name of this test process ("gw0", "gw1", ...); None without xdist.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_INDEX = int(XDIST_WORKER[2:]) if XDIST_WORKER and XDIST_WORKER[2:].isdigit() else None


def _on_vhost(url: str, vhost: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + vhost))


#: Each test process has a RabbitMQ vhost and a Redis database of its own, unless the
#: environment names them: Celery workers of tests running side by side would otherwise
#: meet on the broker (one node name's exclusive pidbox queue, each other's broadcasts).
#: Tests within a process run one after another, as without xdist.
PROCESS_VHOST = (f"pulse_{XDIST_WORKER}" if _INDEX is not None
                 and "PULSE_TEST_AMQP" not in os.environ else None)
RABBIT_URL = (_on_vhost(plugin_services.RABBITMQ_URL, PROCESS_VHOST) if PROCESS_VHOST
              else plugin_services.RABBITMQ_URL)  # $PULSE_TEST_AMQP
#: Databases 8 (the benchmarks' results) and 13 (the pytest-celery nodes') are taken.
_REDIS_DBS = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 14, 15]


def _redis_url() -> str:
    if "PULSE_TEST_REDIS" in os.environ:
        return os.environ["PULSE_TEST_REDIS"]
    if _INDEX is None:
        return "redis://127.0.0.1:6379/0"
    if len(_REDIS_DBS) > _INDEX:
        return f"redis://127.0.0.1:6379/{_REDIS_DBS[_INDEX]}"
    raise RuntimeError(f"more test processes than Redis databases for them ({XDIST_WORKER}): "
                       "run fewer (-n) or set PULSE_TEST_REDIS")


REDIS_URL = _redis_url()
#: Why this process's vhost could not be made (its RabbitMQ tests then skip, or fail in CI).
_vhost_error: str | None = None
#: Our tests' schemas (databases on MariaDB): not the pytest-celery plugin's "t_", whose
#: leftover check (tests/plugin/test_user_suite.py) must see only its own.
SCHEMA_PREFIX = "pt_"


def require(name: str) -> None:
    """Skip (locally) or fail (CI) when service ``name`` is not reachable."""
    plugin_services.require(name, *SERVICES[name])
    if name == "rabbitmq" and _vhost_error is not None:
        _skip_or_fail(f"RabbitMQ vhost {PROCESS_VHOST} could not be made: {_vhost_error}", "")


def _skip_or_fail(message: str, in_ci: str) -> None:
    """Skip the test with ``message``; with ``CI=true`` fail it, adding ``in_ci``."""
    if IN_CI:
        pytest.fail(message + in_ci, pytrace=False)
    pytest.skip(message)


def make_process_vhost() -> None:
    """Create this test process's vhost (emptied first: an earlier run may have left
    things in it). Done once per process, at session start; an error is kept for
    :func:`require` to report."""
    global _vhost_error
    if PROCESS_VHOST is None or not reachable(*SERVICES["rabbitmq"]):
        return
    try:
        _rabbitmqctl("delete_vhost", PROCESS_VHOST, check=False)
        _rabbitmqctl("add_vhost", PROCESS_VHOST)
        _rabbitmqctl("set_permissions", "-p", PROCESS_VHOST, "guest", ".*", ".*", ".*")
    except (OSError, AssertionError, subprocess.SubprocessError) as exc:
        _vhost_error = str(exc)


def drop_process_vhost() -> None:
    """Delete this test process's vhost, with whatever a test left in it."""
    if PROCESS_VHOST is not None and _vhost_error is None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _rabbitmqctl("delete_vhost", PROCESS_VHOST, check=False)


def require_module(module: str, install: str) -> None:
    """Skip (locally) or fail (CI) when the optional ``module`` is not installed."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        _skip_or_fail(f"{module} is not installed ({install})", " (CI=true: .ci/run installs it)")


def tidy_queue(broker_url: str, queue: str) -> None:
    """Delete a test's queue (and its exchange, or its Redis keys) from a shared broker.

    Best effort: a broker that went away (a fault test stops its own) is not an error.
    """
    with contextlib.suppress(Exception):
        if broker_url.startswith("amqp"):
            plugin_services.delete_amqp_entities(broker_url, [queue], [queue])
        elif broker_url.startswith("redis"):
            import redis

            client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
            try:
                keys = list(client.scan_iter(match=f"*{queue}*", count=1000))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()


def _rabbitmqctl(*args: str, check: bool = True) -> str:
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True,
                          timeout=60, check=False)
    assert not check or done.returncode == 0, f"rabbitmqctl {' '.join(args)}: {done.stderr}"
    return done.stdout


@contextlib.contextmanager
def private_vhost(rabbitmq_url: str) -> Iterator[str]:
    """A RabbitMQ vhost of the test's own on the shared server; yields the broker URL on it.

    A test that cuts broker connections cuts only this vhost's, so the tests running beside
    it (pytest-xdist) keep theirs. Deleted, with everything in it, at the end.
    """
    name = f"pulse_{uuid.uuid4().hex[:10]}"
    _rabbitmqctl("add_vhost", name)
    try:
        _rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield _on_vhost(rabbitmq_url, name)
    finally:
        _rabbitmqctl("delete_vhost", name)


def vhost_of(broker_url: str) -> str:
    """The vhost of an ``amqp://`` URL made by :func:`private_vhost`."""
    return broker_url.rsplit("/", 1)[1]


def cut_vhost_connections(broker_url: str, reason: str) -> None:
    """Close every client connection on the vhost of ``broker_url``, as a broker restart
    would (for that vhost only)."""
    _rabbitmqctl("close_all_connections", "--vhost", vhost_of(broker_url), reason)
