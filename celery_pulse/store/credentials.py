"""The credential contract: who may connect to the lease gateway, and which queues it may consume.

Rules:

* A token is ``pgw1_<credential_id>_<secret>``: the id (32 lowercase hex) is public and
  finds the record; the secret (32 random bytes, URL-safe base64 without padding) is
  shown once, when the credential is created, and never stored, logged or shown again.
  The store keeps only its :func:`digest`.
* Every way a token can fail (malformed, unknown id, wrong secret, revoked) raises the
  same :class:`Unauthenticated` with the same message, so a caller learns nothing
  about which it was. The digest is compared in constant time.
* Authorisation is separate: a credential holds *scopes* (:data:`CONNECT` to open a
  session, :data:`CONSUME` to take tasks) and the *queues* it may consume;
  :meth:`Credential.require` raises :class:`Forbidden` naming what is missing.
  Asking for :data:`CONSUME` without a queue is refused at creation.
* Revocation is permanent and takes effect at the next :meth:`CredentialStore.authenticate`
  (seed 003: the credential's validity is checked again for consuming operations, not
  only at the handshake). Revoking twice changes nothing.
* **Expiry and rotation.** A credential may be created with an expiry: from then on, by
  the store's clock, it is refused as a revoked one is (``expired`` is decided by the
  store when it reads the record). :meth:`CredentialStore.rotate_credential` gives the
  same credential (same id, name, scopes and sessions) a new secret and keeps the
  previous one valid for a grace period, so the workers' credential files can be
  replaced one by one: two live secrets, then one.
* A gateway worker *instance* (a process, ``instance_id``) belongs to the credential
  and instance secret that said hello for it first (:meth:`CredentialStore.bind_instance`):
  the store keeps the pair, so another credential, or the same one without the secret,
  takes nothing over on any gateway, restarted or not. Only the secret's digest is kept.
* Store implementations see the digest only: minting, validation and the comparison
  live here, in :class:`CredentialStore`'s concrete methods.

No Celery, no SQL, no gateway: a store contract beside :mod:`celery_pulse.store.base`,
implemented in SQL by :mod:`celery_pulse.store.sql.credentials` and in memory by
:class:`~celery_pulse.store.memory.credentials.MemoryCredentials`. The gateway checks tokens against it
(:mod:`celery_pulse.gateway.server`); ``celery_pulse.gateway.credentials`` is the old
path of this module and keeps working.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable

from celery_pulse.errors import InvalidConfig, NotFound, PulseError

CONNECT = "workers:connect"
CONSUME = "workers:consume"
SCOPES = frozenset({CONNECT, CONSUME})

#: Token format version; a future format gets a new prefix, never a reinterpretation.
PREFIX = "pgw1_"
_TOKEN = re.compile(r"pgw1_([0-9a-f]{32})_([A-Za-z0-9_-]{43})")
_ID = re.compile(r"[0-9a-f]{32}")
#: Operator-chosen names: something a shell and a log line carry without quoting.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,254}")
#: Column widths of the SQL store (names, queues and who-did-it).
MAX_LENGTH = 255
#: Compared against when the id is unknown, so that path does the same work.
_NO_DIGEST = "0" * 64


class Unauthenticated(PulseError):
    """The credential is unknown, malformed or revoked."""


class Forbidden(PulseError):
    """The credential does not grant this operation."""


@dataclasses.dataclass(frozen=True, slots=True)
class Credential:
    """A gateway credential as stored (never its secret)."""

    credential_id: str
    name: str
    scopes: frozenset[str]
    #: Queues it may consume, sorted.
    queues: tuple[str, ...]
    created_at: float
    created_by: str
    revoked_at: float | None = None
    revoked_by: str | None = None
    #: When it stops authenticating (store clock; None: never), and whether it had when
    #: the store read it.
    expires_at: float | None = None
    expired: bool = False
    #: Its latest rotation, and until when the secret before it is still accepted.
    rotated_at: float | None = None
    rotated_by: str | None = None
    previous_until: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None and not self.expired

    def allows(self, scope: str, queue: str | None = None) -> bool:
        """Whether this credential, not revoked, grants ``scope`` (and ``queue``, if given)."""
        return (self.active and scope in self.scopes
                and (queue is None or queue in self.queues))

    def require(self, scope: str, queue: str | None = None) -> None:
        """Raise unless :meth:`allows`: :class:`Unauthenticated` if revoked (as
        :meth:`CredentialStore.authenticate` would), else :class:`Forbidden` naming the
        scope or the queue."""
        if not self.active:
            raise Unauthenticated()
        if scope not in self.scopes:
            raise Forbidden(f"the credential does not grant {scope}")
        if queue is not None and queue not in self.queues:
            raise Forbidden(f"the credential may not consume queue {queue!r}")


def mint() -> tuple[str, str, str]:
    """A fresh ``(credential_id, secret, token)``."""
    credential_id = secrets.token_hex(16)
    secret, token = mint_secret(credential_id)
    return credential_id, secret, token


def mint_secret(credential_id: str) -> tuple[str, str]:
    """A fresh ``(secret, token)`` for the credential ``credential_id``."""
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")
    return secret, f"{PREFIX}{credential_id}_{secret}"


def parse_token(token: str) -> tuple[str, str]:
    """``(credential_id, secret)`` of a token; :class:`Unauthenticated` on anything else
    (wrong type, prefix, length or alphabet, surrounding whitespace, a secret that is
    not the canonical encoding of 32 bytes)."""
    if not isinstance(token, str) or len(token) != len(PREFIX) + 32 + 1 + 43:
        raise Unauthenticated()
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise Unauthenticated()
    credential_id, secret = match.groups()
    # 43 characters carry 258 bits: the last one must leave the 2 spare bits zero, or
    # several spellings would be the same secret.
    raw = base64.urlsafe_b64decode(secret + "=")
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != secret:
        raise Unauthenticated()
    return credential_id, secret


def digest(secret: str) -> str:
    """The stored form of a secret: SHA-256, hex.

    A fast hash is right here, unlike for passwords: the secret is 256 bits from the OS
    random source, so there is no dictionary to try and brute force is out of reach
    whatever the hash costs; a slow KDF would only make each gateway handshake (and
    each re-check before a consuming operation) expensive. Compare with
    :func:`hmac.compare_digest`, never ``==``.
    """
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def is_credential_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def checked(name: str, scopes: Iterable[str], queues: Iterable[str]
            ) -> tuple[str, frozenset[str], tuple[str, ...]]:
    """Validate a new credential's fields: ``(name, scopes, sorted distinct queues)``,
    or :class:`InvalidConfig` saying what is wrong."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise InvalidConfig(
            f"invalid credential name {name!r}: 1-{MAX_LENGTH} characters of letters, digits "
            f"and ._:@+- starting with a letter or digit")
    if is_credential_id(name):
        raise InvalidConfig(f"invalid credential name {name!r}: 32 hex digits would read as "
                            f"a credential id")
    wanted = frozenset(scopes)
    unknown = sorted(wanted - SCOPES)
    if unknown:
        raise InvalidConfig(f"unknown scope(s) {', '.join(map(repr, unknown))}: "
                            f"known scopes are {', '.join(sorted(SCOPES))}")
    if not wanted:
        raise InvalidConfig(f"a credential needs at least one scope ({', '.join(sorted(SCOPES))})")
    queue_list = tuple(sorted(set(queues)))
    for queue in queue_list:
        if (not isinstance(queue, str) or not queue.strip() or len(queue) > MAX_LENGTH
                or not queue.isprintable()):
            raise InvalidConfig(f"invalid queue name {queue!r}")
    if CONSUME in wanted and not queue_list:
        raise InvalidConfig(f"{CONSUME} needs at least one queue the credential may consume")
    return name, wanted, queue_list


def _who(who: str) -> str:
    # Audit only: a longer user@host is cut to the column's width rather than refused.
    return who[:MAX_LENGTH]


class CredentialStore(abc.ABC):
    """Where gateway credentials live (see the module's rules)."""

    def create_credential(self, name: str, scopes: Iterable[str], queues: Iterable[str],
                          who: str, expires_in: float | None = None
                          ) -> tuple[Credential, str]:
        """A new credential and its token, the only time the token exists outside its
        holder; ``expires_in`` seconds from now by the store's clock, it stops
        authenticating (None: never). :class:`InvalidConfig` on an invalid or taken name,
        an unknown scope, :data:`CONSUME` without queues, or an expiry not in the future."""
        name, wanted, queue_list = checked(name, scopes, queues)
        if expires_in is not None and not expires_in > 0:
            raise InvalidConfig(f"a credential's expiry must be in the future, not in "
                                f"{expires_in:g} s")
        credential_id, secret, token = mint()
        record = self._insert(credential_id, name, wanted, queue_list, digest(secret),
                              _who(who), expires_in)
        return record, token

    def rotate_credential(self, name_or_id: str, who: str, grace: float
                          ) -> tuple[Credential, str]:
        """A new secret for the credential (its id, name, scopes and sessions kept): the
        new token, shown this once. The secret it had stays valid for ``grace`` seconds
        (0: refused at once); a rotation during a grace ends the older one (only the
        latest two secrets live). :class:`NotFound` if there is no such credential,
        :class:`InvalidConfig` if it is revoked or expired."""
        if not grace >= 0:
            raise InvalidConfig(f"a rotation's grace is 0 seconds or more, not {grace:g}")
        found = self._find(name_or_id)
        if found is None:
            raise not_found(name_or_id)
        if not found.active:
            raise InvalidConfig(f"credential {found.name!r} is "
                                f"{'revoked' if found.revoked_at is not None else 'expired'}"
                                f": create a new one instead of rotating it")
        secret, token = mint_secret(found.credential_id)
        record = self._rotate(found.credential_id, digest(secret), grace, _who(who))
        if record is None:  # revoked meanwhile
            raise InvalidConfig(f"credential {found.name!r} was revoked meanwhile")
        return record, token

    def authenticate(self, token: str) -> Credential:
        """The active credential ``token`` belongs to; :class:`Unauthenticated` if it is
        malformed, unknown, revoked or its secret is wrong (one message for all)."""
        credential_id, secret = parse_token(token)
        found = self._lookup(credential_id)
        stored = found[1] if found is not None else (_NO_DIGEST,)
        presented = digest(secret)
        matches = False
        for live in (*stored, _NO_DIGEST)[:2]:  # the same work for one live secret or two
            matches |= hmac.compare_digest(presented, live)
        if found is None or not matches or not found[0].active:
            raise Unauthenticated()
        return found[0]

    def revoke_credential(self, name_or_id: str, who: str) -> Credential:
        """Revoke by name or id, for good. Already revoked: returned unchanged (who and
        when of the first revocation kept). :class:`NotFound` if there is no such."""
        return self._revoke(name_or_id, _who(who))

    def bind_instance(self, instance_id: str, credential_id: str, instance_secret: str
                      ) -> bool:
        """Whether gateway instance ``instance_id`` is this credential's and secret's:
        True if it was unbound (bound now, by the write itself: of two first hellos at
        once, one wins) or already theirs (its ``seen_at`` moved on); False if another
        credential or secret holds it, which changes nothing."""
        if not is_credential_id(instance_id):
            raise ValueError("an instance id is 32 lowercase hex digits")
        return self._bind(instance_id, credential_id, digest(instance_secret))

    @abc.abstractmethod
    def _bind(self, instance_id: str, credential_id: str, secret_digest: str) -> bool:
        """:meth:`bind_instance` on the store."""

    @abc.abstractmethod
    def list_credentials(self, include_revoked: bool = True) -> list[Credential]:
        """Every credential (or only active ones), by name."""

    @abc.abstractmethod
    def get_credential(self, credential_id: str) -> Credential | None:
        """The credential with this id, revoked or not; None if there is none."""

    def get_credentials(self, credential_ids: Iterable[str]) -> dict[str, Credential]:
        """Each of these credentials there is, by id, revoked or not (a gateway reads its
        sessions' credentials at once; a store may do it in one statement)."""
        found = {i: self.get_credential(i) for i in set(credential_ids)}
        return {i: c for i, c in found.items() if c is not None}

    @abc.abstractmethod
    def _insert(self, credential_id: str, name: str, scopes: frozenset[str],
                queues: tuple[str, ...], secret_digest: str, who: str,
                expires_in: float | None = None) -> Credential:
        """Store a validated credential, created now by the store clock (expiring
        ``expires_in`` after); :class:`InvalidConfig` if ``name`` is taken (decided by the
        write itself)."""

    @abc.abstractmethod
    def _lookup(self, credential_id: str) -> tuple[Credential, tuple[str, ...]] | None:
        """The record and the digests of its live secrets: the current one, and the one
        before it while its rotation's grace lasts (by the store clock)."""

    @abc.abstractmethod
    def _find(self, name_or_id: str) -> Credential | None:
        """The credential with this name or id, revoked or not."""

    @abc.abstractmethod
    def _rotate(self, credential_id: str, secret_digest: str, grace: float, who: str
                ) -> Credential | None:
        """Make ``secret_digest`` the current secret, the current one the previous,
        valid ``grace`` more seconds; None if the credential is revoked."""

    @abc.abstractmethod
    def _revoke(self, name_or_id: str, who: str) -> Credential:
        """:meth:`revoke_credential` on the store."""


def taken(name: str) -> InvalidConfig:
    return InvalidConfig(f"a credential named {name!r} already exists (revoked ones keep "
                         f"their name): choose another name")


def not_found(name_or_id: str) -> NotFound:
    return NotFound(f"no credential named or with id {name_or_id!r}")
