"""The old path of the credential contract, kept for imports written against it.

The contract is a store contract and lives with them, in
:mod:`celery_pulse.store.credentials`: the SQL store implements it without importing the
gateway, and the gateway checks tokens against it.
"""

from __future__ import annotations

from celery_pulse.store.credentials import (
    CONNECT,
    CONSUME,
    MAX_LENGTH,
    PREFIX,
    SCOPES,
    Credential,
    CredentialStore,
    Forbidden,
    Unauthenticated,
    checked,
    digest,
    is_credential_id,
    mint,
    not_found,
    parse_token,
    taken,
)
from celery_pulse.store.memory.credentials import MemoryCredentials

__all__ = ["CONNECT", "CONSUME", "MAX_LENGTH", "PREFIX", "SCOPES", "Credential",
           "CredentialStore", "Forbidden", "MemoryCredentials", "Unauthenticated", "checked",
           "digest", "is_credential_id", "mint", "not_found", "parse_token", "taken"]
