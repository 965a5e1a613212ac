"""The store contract: every rule the mechanism relies on, independent of SQL.

Rules common to every method:

* Time is the **store's clock**. "Expired" means ``expires_at <= store_now`` as the
  store evaluates it inside the statement; callers never compare their own clock
  with a stored timestamp. Timestamps returned are store-clock seconds since the
  epoch (float), useful only for display and for differences with :meth:`now`.
* Tokens are minted by the store inside the atomic statement that grants them
  (at least 128 bits of randomness). A token is the only credential.
* A store that cannot be reached raises :class:`~celery_pulse.errors.StoreUnavailable`;
  a store without the current schema raises :class:`~celery_pulse.errors.SchemaMissing`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """A granted worker registration."""

    worker_id: str
    token: str
    expires_at: float

    def __repr__(self) -> str:  # tokens are never shown in full
        return (f"Registration(worker_id={self.worker_id!r}, token={mask_token(self.token)!r}, "
                f"expires_at={self.expires_at!r})")


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """The answer to a successful heartbeat."""

    expires_at: float
    draining: bool


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One row of the registry as seen now by the store clock."""

    worker_id: str
    labels: Mapping[str, Any]
    registered_at: float
    last_heartbeat: float
    expires_at: float
    alive: bool
    #: ``expires_at - store_now`` (negative once expired).
    expires_in: float
    draining: bool


def mask_token(token: str) -> str:
    """The first 6 characters of a token: enough to correlate logs, useless to an attacker."""
    return token[:6] + "…" if token else ""


class Store(abc.ABC):
    """What the mechanism needs from persistent storage."""

    # -- housekeeping -------------------------------------------------------
    @abc.abstractmethod
    def now(self) -> float:
        """The store clock (seconds since the epoch)."""

    @abc.abstractmethod
    def check_schema(self) -> None:
        """Raise :class:`SchemaMissing` unless the schema is present and current."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # -- worker registry (seed 000 ``Registry``) ----------------------------
    @abc.abstractmethod
    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        """Register ``worker_id`` for ``ttl`` seconds under a freshly minted token.

        The same id replaces any earlier registration (a restarted worker is normal):
        the old token stops working at once. With ``replace_live=False`` a live
        registration is left alone and :class:`NotRegistered` (``replaced``) is
        raised instead — how a worker whose own registration expired takes its name
        back without stealing it from a newer process. The drain flag is kept.
        """

    @abc.abstractmethod
    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        """Extend the registration to ``store_now + ttl`` in one atomic statement.

        Applies only if ``token`` is the current token *and* the registration has
        not expired; otherwise raises :class:`NotRegistered` whose ``reason`` is
        ``replaced`` (a live registration with another token holds the name),
        ``expired`` (ours, or a dead one, ran out) or ``missing`` (no row).
        """

    @abc.abstractmethod
    def deregister(self, worker_id: str, token: str) -> bool:
        """Remove the registration if ``token`` is current; True if a row went away."""

    @abc.abstractmethod
    def list_workers(self) -> list[WorkerInfo]:
        """Every registration, with ``alive`` judged by the store clock, ordered by id."""
