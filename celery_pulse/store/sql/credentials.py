"""Gateway credentials in SQL (``pulse_credentials``; the contract and its rules are in
:mod:`celery_pulse.store.credentials`).

Only the digest of a secret reaches this module, and so the table. A name is taken by
the insert itself (an upsert that changes nothing when the unique name exists, then a
read of whose row holds the name), not by a read before it: two operators creating the
same name at once get one credential and one clear refusal, never a driver error.
Times are the store clock's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.credentials import (
    Credential,
    CredentialStore,
    is_credential_id,
    not_found,
    taken,
)
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import credentials, gateway_instances

#: Every column but the digests: what a listing reads.
_RECORD = [c for c in credentials.c if not c.name.endswith("_digest")]


def _time(value: Any) -> float | None:
    return None if value is None else float(value)


def _record(row: Any) -> Credential:
    return Credential(
        credential_id=row.credential_id, name=row.name,
        scopes=frozenset(json.loads(row.scopes)), queues=tuple(sorted(json.loads(row.queues))),
        created_at=float(row.created_at), created_by=row.created_by,
        revoked_at=_time(row.revoked_at), revoked_by=row.revoked_by,
        expires_at=_time(row.expires_at), expired=bool(row.expired),
        rotated_at=_time(row.rotated_at), rotated_by=row.rotated_by,
        previous_until=_time(row.previous_until))


class SqlCredentials(CredentialStore):
    """The ``pulse_credentials`` table on one engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.conns = Connections(engine)
        self.dialect = self.conns.dialect
        now = self.conns.now
        #: Expired by the store's clock, decided in the read itself.
        self._expired = sa.case((sa.and_(credentials.c.expires_at.is_not(None),
                                         credentials.c.expires_at <= now), 1),
                                else_=0).label("expired")
        #: The rotation's previous secret while its grace lasts, else NULL.
        self._previous = sa.case((credentials.c.previous_until > now,
                                  credentials.c.previous_digest), else_=None).label("previous")

    def _read(self, where: str) -> AbstractContextManager[sa.Connection]:
        """Reads need no transaction: autocommit on PostgreSQL (one round trip)."""
        return self.conns.reading(where, outside_transaction=False)

    @contextmanager
    def _write(self, where: str) -> Iterator[sa.Connection]:
        with translated(where), self.engine.begin() as conn:
            yield conn

    def _by(self, conn: sa.Connection, where: sa.ColumnElement[bool]) -> Credential | None:
        row = conn.execute(sa.select(*_RECORD, self._expired).where(where)).one_or_none()
        return None if row is None else _record(row)

    def _insert(self, credential_id: str, name: str, scopes: frozenset[str],
                queues: tuple[str, ...], secret_digest: str, who: str,
                expires_in: float | None = None) -> Credential:
        now = self.dialect.now()
        stmt = self.dialect.insert_or_keep(credentials, dict(
            credential_id=credential_id, name=name, secret_digest=secret_digest,
            scopes=json.dumps(sorted(scopes)), queues=json.dumps(list(queues)),
            created_at=now, created_by=who,
            expires_at=None if expires_in is None else now + expires_in),
            [credentials.c.name], credentials.c.credential_id)
        with self._write("create credential") as conn:
            conn.execute(stmt)
            record = self._by(conn, credentials.c.name == name)
        if record is None or record.credential_id != credential_id:
            raise taken(name)
        return record

    def _bind(self, instance_id: str, credential_id: str, secret_digest: str) -> bool:
        # Bound by the insert itself (a row already there is kept as it is), then the
        # owner's latest hello recorded: only a row the pair owns is updated.
        table = gateway_instances
        now = self.dialect.now()
        claim = self.dialect.insert_or_keep(table, dict(
            instance_id=instance_id, credential_id=credential_id,
            secret_digest=secret_digest, created_at=now, seen_at=now),
            [table.c.instance_id], table.c.instance_id)
        seen = sa.update(table).where(
            table.c.instance_id == instance_id, table.c.credential_id == credential_id,
            table.c.secret_digest == secret_digest).values(seen_at=now)
        with self._write("bind gateway instance") as conn:
            conn.execute(claim)
            return conn.execute(seen).rowcount == 1

    def _lookup(self, credential_id: str) -> tuple[Credential, tuple[str, ...]] | None:
        with self._read("authenticate") as conn:
            row = conn.execute(sa.select(credentials, self._expired, self._previous).where(
                credentials.c.credential_id == credential_id)).one_or_none()
        if row is None:
            return None
        live = (str(row.secret_digest),) + ((str(row.previous),) if row.previous else ())
        return _record(row), live

    def _find(self, name_or_id: str) -> Credential | None:
        with self._read("find credential") as conn:
            return self._by(conn, self._match(name_or_id))

    def _rotate(self, credential_id: str, secret_digest: str, grace: float, who: str
                ) -> Credential | None:
        now = self.dialect.now()
        c = credentials.c
        with self._write("rotate credential") as conn:
            # In this order: MySQL assigns left to right, each seeing the ones before.
            moved = conn.execute(sa.update(credentials).where(
                c.credential_id == credential_id, c.revoked_at.is_(None)).ordered_values(
                (c.previous_digest, c.secret_digest), (c.previous_until, now + grace),
                (c.secret_digest, secret_digest), (c.rotated_at, now), (c.rotated_by, who)))
            return (self._by(conn, c.credential_id == credential_id)
                    if moved.rowcount == 1 else None)

    def _match(self, name_or_id: str) -> sa.ColumnElement[bool]:
        # Names are never 32 hex digits (checked at creation), ids always are.
        if is_credential_id(name_or_id):
            return credentials.c.credential_id == name_or_id
        return credentials.c.name == name_or_id

    def _revoke(self, name_or_id: str, who: str) -> Credential:
        match = self._match(name_or_id)
        with self._write("revoke credential") as conn:
            conn.execute(sa.update(credentials).where(match, credentials.c.revoked_at.is_(None))
                         .values(revoked_at=self.dialect.now(), revoked_by=who))
            record = self._by(conn, match)
        if record is None:
            raise not_found(name_or_id)
        return record

    def list_credentials(self, include_revoked: bool = True) -> list[Credential]:
        stmt = sa.select(*_RECORD, self._expired).order_by(credentials.c.name)
        if not include_revoked:
            stmt = stmt.where(credentials.c.revoked_at.is_(None))
        with self._read("list credentials") as conn:
            return [_record(row) for row in conn.execute(stmt)]

    def get_credential(self, credential_id: str) -> Credential | None:
        if not is_credential_id(credential_id):
            return None
        with self._read("get credential") as conn:
            return self._by(conn, credentials.c.credential_id == credential_id)

    def get_credentials(self, credential_ids: Iterable[str]) -> dict[str, Credential]:
        wanted = sorted({i for i in credential_ids if is_credential_id(i)})
        if not wanted:
            return {}
        with self._read("get credentials") as conn:
            rows = conn.execute(sa.select(*_RECORD, self._expired).where(
                credentials.c.credential_id.in_(wanted)))
            return {row.credential_id: _record(row) for row in rows}
