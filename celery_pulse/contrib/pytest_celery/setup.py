"""pytest-celery's test setup with pulse's helpers: look at claims, expire leases, cut the store."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from celery import Celery
from pytest_celery import CeleryTestSetup

import celery_pulse
from celery_pulse.testing import ClaimTools, locked_store


class PulseTestSetup(CeleryTestSetup, ClaimTools):
    """``celery_setup`` for pulse workers.

    Everything of pytest-celery's setup (``app``, ``worker``, ``worker_cluster``,
    ``broker``, ``backend``, ``ready()`` ...) plus the claim tools of
    :class:`celery_pulse.testing.ClaimTools` (``claim``, ``wait_for_claim``,
    ``expire_lease``, ``steal_lease``) on the workers' store, and
    :meth:`store_outage`.
    """

    _store: Any = None

    @classmethod
    def update_app_config(cls, app: Celery) -> None:
        """The test's app publishes as a pulse app does (publication headers ...)."""
        celery_pulse.install(app)

    @property
    def store_url(self) -> str:
        return str(self.app.conf.pulse_store_url)

    @property
    def store(self) -> Any:
        """The workers' store, opened on first use (closed at teardown)."""
        if self._store is None:
            from celery_pulse.store.sql import open_store

            self._store = open_store(self.store_url, check_schema=False)
        return self._store

    @contextlib.contextmanager
    def store_outage(self) -> Iterator[None]:
        """The workers' store stops answering until the block exits.

        See :func:`celery_pulse.testing.locked_store`: the workers renew nothing, stop
        taking work, and at their local deadline their running tasks get
        :class:`~celery_pulse.LeaseLost`.
        """
        with locked_store(self.store_url):
            yield

    def teardown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self.app is not None:
            self.app.close()
        super().teardown()
