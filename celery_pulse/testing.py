"""Test your own tasks against pulse, without Docker or servers.

:func:`pulse_worker` runs a real ``-P pulse`` worker (prefork children and all)
inside the test process, on a temporary SQLite store and kombu's ``filesystem://``
broker, with short TTLs. The handle it yields can make a running task lose its lease
(:meth:`PulseTestWorker.steal_lease`, :meth:`PulseTestWorker.expire_lease`) or make
the worker's store go away (:meth:`PulseTestWorker.store_outage`), so a test can
check that a task stops on :class:`~celery_pulse.LeaseLost` and that its fenced
writes never land::

    from celery_pulse.testing import pulse_worker

    def test_charge_stops_when_its_lease_is_taken(tmp_path):
        with pulse_worker(app, tmp_path) as worker:
            result = charge.delay("order-1")
            worker.wait_for_claim(result.id, "running")
            worker.steal_lease(result.id)
            worker.wait_for_attempt_end(result.id)  # stopped by LeaseLost
            assert result.state == "PENDING"  # a stale attempt writes no result

With pytest, ``pytest_plugins = ["celery_pulse.testing"]`` in a ``conftest.py``
adds the ``pulse_worker_factory`` fixture. Limits: one pulse worker per test process
at a time, and :func:`pulse_worker` configures the app it is given (broker, result
backend, store, TTLs) — use an app your tests own, before it sends anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from celery_pulse.embedded import atomic_filesystem_puts
from celery_pulse.errors import NotFound, StoreUnavailable
from celery_pulse.store.base import ClaimInfo, Store

__all__ = [
    "FAST_SETTINGS",
    "ClaimTools",
    "PulseTestWorker",
    "atomic_filesystem_puts",
    "embedded_conf",
    "locked_store",
    "pulse_worker",
    "pulse_worker_factory",
    "wait_for",
]

T = TypeVar("T")

#: Short TTLs so a test sees loss, takeover and recovery in about a second.
FAST_SETTINGS: dict[str, Any] = {
    "pulse_worker_ttl": 3.0,
    "pulse_heartbeat_interval": 0.5,
    "pulse_lease_ttl": 2.0,
    "pulse_renew_interval": 0.25,
    "pulse_revoke_grace": 1.0,
    "pulse_recover_interval": 0.25,
    "pulse_leader_ttl": 3.0,
    "pulse_beat": False,
}


def wait_for(predicate: Callable[[], T | None], timeout: float = 10.0, what: str = "a condition",
             interval: float = 0.05, error: type[Exception] = AssertionError) -> T:
    """Poll ``predicate`` until it returns something truthy; ``error`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)




def embedded_conf(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Celery settings for a self-contained test setup in ``folder``.

    A ``filesystem://`` broker (fanout works, so ``inspect`` and ``revoke`` do too),
    a ``file://`` result backend shared by the worker's processes and the test, and
    a SQLite pulse store.
    """
    root = Path(folder).resolve()
    broker = root / "broker"
    for sub in ("in", "processed", "control"):
        (broker / sub).mkdir(parents=True, exist_ok=True)
    (root / "results").mkdir(parents=True, exist_ok=True)
    return {
        "broker_url": "filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(broker / "in"), "data_folder_out": str(broker / "in"),
            "processed_folder": str(broker / "processed"),
            "control_folder": str(broker / "control"), "store_processed": False,
            "polling_interval": 0.05,
        },
        "result_backend": f"file://{root / 'results'}",
        "pulse_store_url": f"sqlite:///{root / 'pulse.sqlite3'}",
        "broker_connection_retry_on_startup": True,
    }


def _open_store(url: str) -> Any:
    from celery_pulse.store.sql import open_store

    return open_store(url, check_schema=False)


def migrate(store_url: str) -> None:
    """Create or upgrade the pulse schema at ``store_url`` (idempotent)."""
    store = _open_store(store_url)
    try:
        store.migrate()
    finally:
        store.close()


#: Store methods the worker calls; an outage makes each of them raise.
_STORE_METHODS = tuple(sorted({*Store.__abstractmethods__, "set_drain"}))


class ClaimTools:
    """Look at and break claims in the store a worker uses (``self.store``)."""

    store: Any

    # -- looking -------------------------------------------------------------------------
    def claim(self, task_id: str) -> ClaimInfo | None:
        """The claim row of ``task_id`` as the store sees it now, or None."""
        for info in self.store.list_claims(None, limit=100_000):
            if info.task_id == task_id:
                return info  # type: ignore[no-any-return]
        return None

    def wait_for_claim(self, task_id: str, *states: str, timeout: float = 10.0) -> ClaimInfo:
        """Wait until ``task_id``'s claim is in one of ``states`` (any state if none given)."""
        def ready() -> ClaimInfo | None:
            info = self.claim(task_id)
            return info if info is not None and (not states or info.state in states) else None
        what = f"claim {task_id} in state {'/'.join(states) or 'any'}"
        return wait_for(ready, timeout, what)

    # -- breaking ------------------------------------------------------------------------
    def steal_lease(self, task_id: str, *, holder: str = "thief", ttl: float = 60.0) -> int:
        """Hand ``task_id``'s lease to someone else, as a takeover would. Returns the new epoch.

        In the store: a new epoch, another holder, a fresh token, a lease of ``ttl``
        seconds by the store clock. The worker finds out at its next renewal (within
        ``pulse_renew_interval``) and raises :class:`~celery_pulse.LeaseLost` inside the
        task; a ``lease.fenced`` block refuses to commit from then on.
        """
        return _rewrite_claim(self.store, task_id, holder=holder, lease=ttl)

    def expire_lease(self, task_id: str) -> int:
        """End ``task_id``'s lease now, as if its worker had stopped renewing.

        The worker loses it at its next renewal; then Recover takes the claim over
        (policy ``redispatch``: run again; ``review``: ``needs_review``). Returns the
        epoch the lost lease had.
        """
        return _rewrite_claim(self.store, task_id, holder=None, lease=None)


@dataclasses.dataclass
class PulseTestWorker(ClaimTools):
    """A running in-process pulse worker and the tools to break things under it."""

    app: Any
    controller: Any
    store_url: str
    folder: Path
    store: Any = dataclasses.field(default=None, repr=False)

    @property
    def hostname(self) -> str:
        return str(self.controller.hostname)

    @property
    def pulse(self) -> Any:
        """The worker's pulse runtime (its store, lease keeper, membership...)."""
        return self.controller.pulse

    def wait_for_attempt_end(self, task_id: str, timeout: float = 10.0) -> None:
        """Wait until this worker no longer holds or runs any attempt of ``task_id``.

        After a lost lease this is how a test sees the stale attempt stop: it ends on
        :class:`~celery_pulse.LeaseLost` but writes nothing to the result backend (only
        the attempt that holds the lease does), so ``result.get()`` can't show it.
        """
        wait_for(lambda: not self.pulse.keeper.attempts(task_id), timeout,
                 f"this worker's attempt of {task_id} to end")

    @contextlib.contextmanager
    def store_outage(self) -> Iterator[None]:
        """Make the worker's store unreachable until the block exits.

        Every store call of the worker process (heartbeat, reservation, renewal,
        completion, recover, leader election) raises
        :class:`~celery_pulse.StoreUnavailable`. The worker stops taking work, and at
        its local deadline (``pulse_lease_ttl`` after the last renewal, minus a safety
        margin) it treats every lease as lost: ``LeaseLost`` inside running tasks.
        Not affected: connections the pool processes and your tasks open themselves.
        """
        target = self.pulse.store

        def down(*_args: Any, **_kwargs: Any) -> Any:
            raise StoreUnavailable("store unavailable (celery_pulse.testing.store_outage)")

        for name in _STORE_METHODS:
            setattr(target, name, down)
        try:
            yield
        finally:
            for name in _STORE_METHODS:
                with contextlib.suppress(AttributeError):
                    delattr(target, name)


def _rewrite_claim(store: Any, task_id: str, *, holder: str | None, lease: float | None) -> int:
    """Store-side takeover (``holder``/``lease`` given) or expiry (both None)."""
    import sqlalchemy as sa

    from celery_pulse.store.sql.tables import claims

    now = store.dialect.now()
    live = sa.and_(claims.c.task_id == task_id, claims.c.state.in_(("reserved", "running")))
    if holder is None:
        stmt = (sa.update(claims).where(live).values(lease_until=now - 1.0)
                .returning(claims.c.epoch))
    else:
        stmt = (sa.update(claims).where(live)
                .values(epoch=claims.c.epoch + 1, holder=holder, token=secrets.token_hex(16),
                        lease_until=now + float(lease or 60.0))
                .returning(claims.c.epoch))
    with store.engine.begin() as conn:
        epoch = conn.execute(stmt).scalar_one_or_none()
    if epoch is None:
        raise NotFound(f"no reserved or running claim for task {task_id}")
    return int(epoch)


@contextlib.contextmanager
def locked_store(store_url: str) -> Iterator[None]:
    """Hold the pulse tables locked until the block exits: the store stops answering.

    For a worker in another process, where :meth:`PulseTestWorker.store_outage` can't
    reach. On PostgreSQL every pulse table is locked ``ACCESS EXCLUSIVE`` (each
    statement of the worker waits), on MySQL/MariaDB ``LOCK TABLES .. WRITE`` (likewise),
    on SQLite the database is locked for writing (each write waits out the busy
    timeout, then fails). Either way the worker
    renews nothing, and at its local deadline it treats every lease as lost.
    """
    import sqlalchemy as sa

    from celery_pulse.store.sql.tables import metadata
    from celery_pulse.store_urls import canonical_store_url

    engine = sa.create_engine(canonical_store_url(store_url), poolclass=sa.pool.NullPool)
    quoted = [engine.dialect.identifier_preparer.quote(t.name) for t in metadata.sorted_tables]
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN EXCLUSIVE")
                release = "ROLLBACK"
            elif engine.dialect.name in ("mysql", "mariadb"):
                conn.exec_driver_sql("LOCK TABLES " + ", ".join(f"{t} WRITE" for t in quoted))
                release = "UNLOCK TABLES"
            else:
                conn.exec_driver_sql("BEGIN")
                conn.exec_driver_sql(f"LOCK TABLE {', '.join(quoted)} IN ACCESS EXCLUSIVE MODE")
                release = "ROLLBACK"
            try:
                yield
            finally:
                conn.exec_driver_sql(release)
    finally:
        engine.dispose()


@contextlib.contextmanager
def pulse_worker(app: Any, folder: str | os.PathLike[str] | None = None, *,
                 concurrency: int = 1, conf: dict[str, Any] | None = None,
                 configure: bool = True, hostname: str | None = None,
                 loglevel: str = "WARNING", ping: bool = True,
                 shutdown_timeout: float = 30.0) -> Iterator[PulseTestWorker]:
    """Run an in-process ``-P pulse`` worker for ``app``; stop it when the block exits.

    ``folder`` holds the broker, result backend and SQLite store (a temporary folder
    when None). With ``configure`` (the default) ``app`` is pointed at them and given
    :data:`FAST_SETTINGS`; ``conf`` overrides any of that. With ``configure=False``
    the app keeps its own settings (its store must be reachable). The schema is
    migrated. Uses :func:`celery.contrib.testing.worker.start_worker` with the pulse
    pool class (prefork children, so ``LeaseLost`` is delivered as in production).
    """
    from celery.contrib.testing.worker import start_worker

    import celery_pulse
    from celery_pulse.pool.prefork import TaskPool

    temporary = folder is None
    root = Path(tempfile.mkdtemp(prefix="pulse-test-") if folder is None else folder)
    try:
        if configure:
            app.conf.update({**embedded_conf(root), **FAST_SETTINGS, **(conf or {})})
        elif conf:
            app.conf.update(conf)
        if str(app.conf.broker_url or "").startswith("filesystem"):
            atomic_filesystem_puts()
        celery_pulse.install(app)
        # start_worker asserts that its ping task is registered, ping or not.
        app.loader.import_task_module("celery.contrib.testing.tasks")
        store_url = str(app.conf.pulse_store_url)
        migrate(store_url)
        store = _open_store(store_url)
        try:
            kwargs: dict[str, Any] = {}
            if hostname is not None:
                kwargs["hostname"] = hostname
            with start_worker(app, pool=TaskPool, concurrency=concurrency, loglevel=loglevel,
                              perform_ping_check=ping, shutdown_timeout=shutdown_timeout,
                              **kwargs) as controller:
                worker = PulseTestWorker(app, controller, store_url, root, store)
                wait_for(lambda: getattr(controller, "pulse", None) is not None
                         and controller.pulse.membership is not None, 10,
                         "the pulse worker to register")
                yield worker
        finally:
            store.close()
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


try:  # optional pytest fixture: pytest_plugins = ["celery_pulse.testing"]
    import pytest
except ImportError:  # pragma: no cover - pytest is not a runtime dependency
    pass
else:
    @pytest.fixture
    def pulse_worker_factory(tmp_path: Path) -> Iterator[Callable[..., PulseTestWorker]]:
        """``start(app, **kwargs)`` -> a running :class:`PulseTestWorker` (stopped at teardown).

        Keyword arguments are those of :func:`pulse_worker`; the folder is the test's
        ``tmp_path``.
        """
        started = 0
        with contextlib.ExitStack() as stack:
            def start(app: Any, **kwargs: Any) -> PulseTestWorker:
                nonlocal started
                started += 1
                kwargs.setdefault("folder", tmp_path / f"pulse-{started}")
                return stack.enter_context(pulse_worker(app, **kwargs))
            yield start
