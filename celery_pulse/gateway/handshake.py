"""The HTTP handshake of ``GET /v1/worker/connect``: who may open a connection.

The rules, before any code: the place is counted from accept, before anything else
(:mod:`.admission`, answered ``OVERLOADED`` with ``Retry-After`` when full); a
browser's request (an ``Origin`` header) is refused 403 unless that origin is allowed
(``--allowed-origin``): a worker sends none, and a page must not be able to use a
credential its browser holds (seed 003's default Origin check); the path
is the one endpoint and takes no query (a credential in the URL would end up in access
logs); the credential is ``Authorization: Bearer`` only, checked against the store with
bounded concurrency (a flood of bogus tokens waits its turn instead of taking the store
from the workers' operations) and must grant ``workers:connect``.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from celery_pulse.gateway.admission import Admission
from celery_pulse.gateway.frames import Code, ProtocolError
from celery_pulse.store.credentials import (
    CONNECT,
    Credential,
    CredentialStore,
    Forbidden,
    Unauthenticated,
)

PATH = "/v1/worker/connect"

T = TypeVar("T")


class Handshake:
    """The handshake half of the gateway server (a mixin)."""

    admission: Admission
    credentials: CredentialStore
    #: Origins whose pages may connect (``--allowed-origin``); none by default.
    allowed_origins: frozenset[str]
    #: Credentials the handshake accepted, until their connection's handler takes them.
    _accepted: dict[ServerConnection, Credential]

    if TYPE_CHECKING:
        async def _store(self, call: Callable[..., T], *args: Any) -> T: ...

    async def _process_request(self, conn: ServerConnection, request: Request
                               ) -> Response | None:
        refusal = self.admission.refusal(conn)
        if refusal is not None:
            return _overloaded(conn, refusal)
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self.allowed_origins:
            return _refuse(conn, HTTPStatus.FORBIDDEN,
                           "this origin may not connect: the endpoint is for workers (allow "
                           "a page's origin with --allowed-origin)")
        parts = urlsplit(request.path)
        if parts.path != PATH:
            return _refuse(conn, HTTPStatus.NOT_FOUND, f"no such endpoint; use {PATH}")
        if parts.query:
            return _refuse(conn, HTTPStatus.BAD_REQUEST,
                           "this endpoint takes no query (credentials in the URL are "
                           "refused): send Authorization: Bearer <token>")
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            response = _refuse(conn, HTTPStatus.UNAUTHORIZED,
                               "send Authorization: Bearer <token>")
            response.headers["WWW-Authenticate"] = 'Bearer realm="pulse.worker.v1"'
            return response
        try:
            # Lookups are bounded: a flood of bogus tokens waits its turn here instead of
            # taking the store and the threads the workers' operations need.
            async with self.admission.checking():
                credential = await self._store(self.credentials.authenticate, token.strip())
            credential.require(CONNECT)
        except Unauthenticated as exc:
            return _refuse(conn, HTTPStatus.UNAUTHORIZED, exc.message)
        except Forbidden as exc:
            return _refuse(conn, HTTPStatus.FORBIDDEN, exc.message)
        except ProtocolError:
            return _refuse(conn, HTTPStatus.SERVICE_UNAVAILABLE, "the store is unavailable")
        refusal = self.admission.authenticated(conn, credential.credential_id)
        if refusal is not None:
            return _overloaded(conn, refusal)
        self._accepted[conn] = credential
        return None

    def _process_response(self, conn: ServerConnection, request: Request, response: Response
                          ) -> None:
        """A handshake refused after the credential check (no common subprotocol, say)
        leaves no place taken."""
        if response.status_code != HTTPStatus.SWITCHING_PROTOCOLS:
            self._accepted.pop(conn, None)
            self.admission.release(conn)


def _refuse(conn: ServerConnection, status: HTTPStatus, text: str) -> Response:
    response = conn.respond(status, text + "\n")
    response.headers = Headers(response.headers)
    return response

def _overloaded(conn: ServerConnection, why: str) -> Response:
    response = _refuse(conn, HTTPStatus.SERVICE_UNAVAILABLE, f"{Code.OVERLOADED}: {why}")
    response.headers["Retry-After"] = "1"
    return response
