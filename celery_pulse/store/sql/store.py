"""The SQL implementation of the store contract (see :mod:`celery_pulse.store.base`).

Every grant is one atomic statement whose ``WHERE`` clause carries both the
credential check (token, epoch) and the expiry check by the store clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig, NotRegistered, SchemaMissing, StoreUnavailable
from celery_pulse.settings import mask_url
from celery_pulse.store.base import Heartbeat, Registration, Store, WorkerInfo
from celery_pulse.store.sql import migrate
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.engine import make_engine
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import workers


class SqlStore(Store):
    """A :class:`Store` on a SQLAlchemy engine (PostgreSQL or SQLite)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = Dialect(engine.dialect.name)
        self._now = self.dialect.now()

    @property
    def url(self) -> str:
        return mask_url(self.engine.url.render_as_string(hide_password=False))

    def close(self) -> None:
        self.engine.dispose()

    # -- housekeeping ---------------------------------------------------------
    def now(self) -> float:
        with translated("now"), self.engine.connect() as conn:
            return float(conn.execute(sa.select(self._now)).scalar_one())

    def check_schema(self) -> None:
        with translated("schema check"):
            current = migrate.current_revision(self.engine)
        head = migrate.head_revision()
        if current != head:
            state = "missing" if current is None else f"at revision {current}, need {head}"
            raise SchemaMissing(f"the pulse schema in {self.url} is {state}: "
                                f"run `celery -A <app> pulse migrate`")

    def migrate(self) -> tuple[str | None, str]:
        with translated("migrate"):
            return migrate.upgrade(self.engine)

    # -- worker registry --------------------------------------------------------
    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        now = self._now
        stmt = self.dialect.insert(workers).values(
            worker_id=worker_id, token=self.dialect.new_token(),
            labels=json.dumps(dict(labels), sort_keys=True, default=str),
            registered_at=now, last_heartbeat=now, expires_at=now + ttl)
        stmt = stmt.on_conflict_do_update(
            index_elements=[workers.c.worker_id],
            set_={c: stmt.excluded[c] for c in
                  ("token", "labels", "registered_at", "last_heartbeat", "expires_at")},
            where=None if replace_live else workers.c.expires_at <= now,
        ).returning(workers.c.token, workers.c.expires_at)
        with translated("register"), self.engine.begin() as conn:
            row = conn.execute(stmt).one_or_none()
        if row is None:
            raise NotRegistered(f"{worker_id}: another process registered this name",
                                reason=NotRegistered.REPLACED)
        return Registration(worker_id, row.token, float(row.expires_at))

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        now = self._now
        stmt = (sa.update(workers)
                .where(workers.c.worker_id == worker_id, workers.c.token == token,
                       workers.c.expires_at > now)
                .values(expires_at=now + ttl, last_heartbeat=now)
                .returning(workers.c.expires_at, workers.c.draining))
        with translated("heartbeat"), self.engine.begin() as conn:
            row = conn.execute(stmt).one_or_none()
            if row is not None:
                return Heartbeat(float(row.expires_at), bool(row.draining))
            # Diagnose only; the grant itself was decided by the statement above.
            other = conn.execute(
                sa.select(workers.c.token, (workers.c.expires_at > now).label("alive"))
                .where(workers.c.worker_id == worker_id)).one_or_none()
        if other is None:
            raise NotRegistered(f"{worker_id}: not registered", reason=NotRegistered.MISSING)
        if other.token != token and other.alive:
            raise NotRegistered(f"{worker_id}: another process registered this name",
                                reason=NotRegistered.REPLACED)
        raise NotRegistered(f"{worker_id}: registration expired", reason=NotRegistered.EXPIRED)

    def deregister(self, worker_id: str, token: str) -> bool:
        stmt = sa.delete(workers).where(workers.c.worker_id == worker_id,
                                        workers.c.token == token)
        with translated("deregister"), self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0

    def list_workers(self) -> list[WorkerInfo]:
        now = sa.select(self._now).scalar_subquery()
        stmt = sa.select(workers, (workers.c.expires_at - now).label("expires_in")
                         ).order_by(workers.c.worker_id)
        with translated("list_workers"), self.engine.connect() as conn:
            rows = conn.execute(stmt).all()
        return [WorkerInfo(r.worker_id, json.loads(r.labels), float(r.registered_at),
                           float(r.last_heartbeat), float(r.expires_at), r.expires_in > 0,
                           float(r.expires_in), bool(r.draining)) for r in rows]


def open_store(url: str, connect_timeout: float = 0.0, check_schema: bool = True) -> SqlStore:
    """Open the store at ``url``, waiting up to ``connect_timeout`` for it to answer.

    Raises InvalidConfig (naming ``pulse_store_url``, password masked) when it never
    answers, and SchemaMissing when the schema is absent or old.
    """
    store = SqlStore(make_engine(url))
    deadline = time.monotonic() + connect_timeout
    delay = 0.2
    while True:
        try:
            store.now()
            break
        except StoreUnavailable as exc:
            if time.monotonic() + delay > deadline:
                store.close()
                raise InvalidConfig(
                    f"pulse_store_url: cannot reach the store at {mask_url(url)} "
                    f"after {connect_timeout:g}s: {exc}", setting="pulse_store_url") from exc
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    if check_schema:
        store.check_schema()
    return store
