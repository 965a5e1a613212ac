"""Who may take one of a gateway's connection places, counted from the moment a
connection is accepted (seed 003 §6).

The rules, before any code:

* **Counted from accept.** A connection takes a place when it is accepted (the TLS
  handshake done), before its upgrade request is read and before its credential is
  looked up; it gives it back when it closes. So simultaneous handshakes can't all pass
  a check made before any of them counted: the first ``max_connections`` hold places,
  the others are refused ``OVERLOADED`` (HTTP 503).
* **Unauthenticated handshakes are bounded.** At most ``max_unauthenticated`` of the
  places are held by connections whose credential isn't checked yet, so a flood of
  bogus handshakes can't fill the gateway while its lookups run.
* **A credential holds at most ``max_per_credential`` places**, so one credential (a
  connect-only one, which can't even say hello, or a leaked one) can't hold every slot.
* **Credential lookups are bounded** (``credential_checks`` at once): a handshake waits
  for its turn, and the store and the gateway's threads stay free for the workers'
  operations (:meth:`Admission.checking`).

Refusals are decided at accept and told at the upgrade request: an HTTP answer is the
only one a handshake can get. :func:`counted` is the hook in websockets' server that
counts a connection at accept and frees its place when it is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from websockets.asyncio.server import ServerConnection

from celery_pulse.gateway.link import Limits

OVERLOADED = "OVERLOADED"


class Admission:
    """The places of one gateway and who holds them (the event loop's thread only)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        #: Places for connections whose credential isn't checked yet (default: a quarter
        #: of the connection limit), and for one credential's (default: half of it).
        self.max_unauthenticated = (limits.max_unauthenticated
                                    or max(1, limits.max_connections // 4))
        self.max_per_credential = (limits.max_per_credential
                                   or max(1, (limits.max_connections + 1) // 2))
        self._held: set[Hashable] = set()
        self._unauthenticated: set[Hashable] = set()
        self._credential: dict[Hashable, str] = {}
        self._per_credential: dict[str, int] = {}
        #: Connections refused at accept, and why (told at their upgrade request).
        self._refused: dict[Hashable, str] = {}
        self._checks: asyncio.Semaphore | None = None
        #: When each connection was accepted (the event loop's clock): the hello's
        #: deadline counts from then.
        self.accepted_at: dict[Hashable, float] = {}

    def accept(self, conn: Hashable) -> None:
        """A connection was accepted: it takes a place, or is marked to be refused."""
        self.accepted_at[conn] = asyncio.get_running_loop().time()
        if len(self._held) >= self.limits.max_connections:
            self._refused[conn] = "too many worker connections on this gateway"
        elif len(self._unauthenticated) >= self.max_unauthenticated:
            self._refused[conn] = "too many handshakes in progress on this gateway"
        else:
            self._held.add(conn)
            self._unauthenticated.add(conn)

    def refusal(self, conn: Hashable) -> str | None:
        """Why ``conn`` is refused (``OVERLOADED``), or None: it holds a place."""
        if conn in self._refused:
            return self._refused[conn]
        if conn not in self._held:  # never counted (accepted before we watched): refuse
            return "this connection holds no place on this gateway"
        return None

    def authenticated(self, conn: Hashable, credential_id: str) -> str | None:
        """``conn``'s credential checked: None, or why it is refused (the credential
        holds all its places)."""
        self._unauthenticated.discard(conn)
        held = self._per_credential.get(credential_id, 0)
        if held >= self.max_per_credential:
            return (f"this credential holds {held} connections on this gateway, its "
                    f"most")
        self._per_credential[credential_id] = held + 1
        self._credential[conn] = credential_id
        return None

    def release(self, conn: Hashable) -> None:
        """``conn`` closed (or its handshake failed): its place is free."""
        self._refused.pop(conn, None)
        self.accepted_at.pop(conn, None)
        self._held.discard(conn)
        self._unauthenticated.discard(conn)
        credential_id = self._credential.pop(conn, None)
        if credential_id is not None:
            left = self._per_credential[credential_id] - 1
            if left:
                self._per_credential[credential_id] = left
            else:
                del self._per_credential[credential_id]

    def checking(self) -> asyncio.Semaphore:
        """Hold it around a credential lookup (``async with``)."""
        if self._checks is None:
            self._checks = asyncio.Semaphore(self.limits.credential_checks)
        return self._checks

    def counts(self) -> tuple[int, int]:
        """``(held, unauthenticated)``: for logs and tests."""
        return len(self._held), len(self._unauthenticated)


def counted(admission: Admission) -> type[ServerConnection]:
    """websockets' connection class, counting each connection in ``admission`` from its
    accept to its loss."""

    class Counted(ServerConnection):
        def connection_made(self, transport: Any) -> None:
            admission.accept(self)
            super().connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            admission.release(self)
            super().connection_lost(exc)

    return Counted
