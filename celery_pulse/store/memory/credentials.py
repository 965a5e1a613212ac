"""Gateway credentials in memory (the contract and its rules are in
:mod:`celery_pulse.store.credentials`), on an injectable store clock: for unit tests and
the memory store."""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_pulse.store.credentials import Credential, CredentialStore, not_found, taken


class MemoryCredentials(CredentialStore):
    """In-memory credentials for unit tests; ``clock`` is the store clock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: credential_id -> [record as stored, digest, previous digest, its end]
        self._rows: dict[str, list[Any]] = {}
        #: instance_id -> (credential_id, secret digest) of its owner.
        self._instances: dict[str, tuple[str, str]] = {}

    def _now(self, record: Credential) -> Credential:
        """The record as read now: expired by the store clock or not."""
        expired = record.expires_at is not None and record.expires_at <= self._clock()
        return dataclasses.replace(record, expired=expired)

    def _bind(self, instance_id: str, credential_id: str, secret_digest: str) -> bool:
        with self._lock:
            owner = self._instances.setdefault(instance_id, (credential_id, secret_digest))
        return (hmac.compare_digest(owner[0], credential_id)
                & hmac.compare_digest(owner[1], secret_digest))

    def _insert(self, credential_id: str, name: str, scopes: frozenset[str],
                queues: tuple[str, ...], secret_digest: str, who: str,
                expires_in: float | None = None) -> Credential:
        with self._lock:
            if any(row[0].name == name for row in self._rows.values()):
                raise taken(name)
            now = self._clock()
            record = Credential(credential_id, name, scopes, queues, now, who,
                                expires_at=None if expires_in is None else now + expires_in)
            self._rows[credential_id] = [record, secret_digest, None, None]
            return self._now(record)

    def _lookup(self, credential_id: str) -> tuple[Credential, tuple[str, ...]] | None:
        with self._lock:
            row = self._rows.get(credential_id)
            if row is None:
                return None
            live = (row[1],) if row[2] is None or row[3] <= self._clock() else (row[1], row[2])
            return self._now(row[0]), live

    def _row(self, name_or_id: str) -> list[Any] | None:
        """The row of the credential with this name or id (the lock held)."""
        for credential_id, row in self._rows.items():
            if name_or_id in (row[0].name, credential_id):
                return row
        return None

    def _find(self, name_or_id: str) -> Credential | None:
        with self._lock:
            row = self._row(name_or_id)
            return None if row is None else self._now(row[0])

    def _rotate(self, credential_id: str, secret_digest: str, grace: float, who: str
                ) -> Credential | None:
        with self._lock:
            row = self._rows[credential_id]
            if row[0].revoked_at is not None:
                return None
            now = self._clock()
            row[0] = dataclasses.replace(row[0], rotated_at=now, rotated_by=who,
                                         previous_until=now + grace)
            row[1:] = [secret_digest, row[1], now + grace]
            return self._now(row[0])

    def _revoke(self, name_or_id: str, who: str) -> Credential:
        with self._lock:
            row = self._row(name_or_id)
            if row is None:
                raise not_found(name_or_id)
            if row[0].revoked_at is None:
                row[0] = dataclasses.replace(row[0], revoked_at=self._clock(), revoked_by=who)
            return self._now(row[0])

    def list_credentials(self, include_revoked: bool = True) -> list[Credential]:
        with self._lock:
            rows = [self._now(row[0]) for row in self._rows.values()]
        return sorted((c for c in rows if include_revoked or c.active), key=lambda c: c.name)

    def get_credential(self, credential_id: str) -> Credential | None:
        found = self._lookup(credential_id)
        return None if found is None else found[0]
