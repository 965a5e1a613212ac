"""What every pulse handler inside Flower shares: the store, filters, who acts, errors.

Pulse's handlers are Flower's: they derive from ``flower.views.BaseHandler`` (pages) and
``flower.api.BaseApiHandler`` (the JSON API), so Flower's authentication (basic auth,
OAuth, ``FLOWER_UNAUTHENTICATED_API`` for the API) and its XSRF policy apply unchanged.
One rule is stricter, because review actions and drains change the cluster: a POST that
comes from a browser (it carries a cookie, an ``Origin`` or ``Sec-Fetch-Site``) must
carry the XSRF token of Flower's ``_xsrf`` cookie, whatever Flower's auth mode; a client
that is not a browser (curl, a script: none of those headers) is judged by Flower's auth.

The store is the app's pulse store, opened once per Flower process on first use (as
``celery pulse`` commands open it) and shared by every request; its calls are blocking, so
they run on Flower's executor, never on the event loop.
"""

from __future__ import annotations

import asyncio
import getpass
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlencode

from flower.api import BaseApiHandler
from flower.views import BaseHandler
from tornado import web

from celery_pulse.errors import InvalidConfig, Moved, NotFound, PulseError
from celery_pulse.settings import Settings
from celery_pulse.store.pages import MAX_PAGE, ClaimQuery
from celery_pulse.store.records import (
    CLAIM_STATES,
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    REVOKED,
    RUNNING,
    SUCCEEDED,
)
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.engine import EngineOptions
from celery_pulse.timefmt import iso

T = TypeVar("T")

#: Query parameters a claim filter takes (``state`` may repeat or be a comma list).
FILTERS = ("state", "queue", "task", "worker", "limit", "after")
#: Beside its own, what a page may also be given (what an action redirects with) ...
PAGE_PARAMS = ("message", "level")
#: ... and what the API may (Flower's own API takes ``refresh``).
API_PARAMS = ("refresh",)
MAX_LIMIT = MAX_PAGE


class PulseContext:
    """The Celery app and its pulse store, one per Flower process."""

    def __init__(self, capp: Any) -> None:
        self.capp = capp
        self._store: SqlStore | None = None
        self._lock = threading.Lock()

    def store(self) -> SqlStore:
        """The store, opened on first use; a failure is retried on the next request."""
        with self._lock:
            if self._store is None:
                try:
                    settings = Settings.from_conf(self.capp.conf)
                    self._store = open_store(settings.store_url,
                                             settings.store_connect_timeout, check_schema=True,
                                             options=EngineOptions.of(settings, "flower"))
                except PulseError as exc:  # the server's configuration or store: a 503
                    raise web.HTTPError(503, f"pulse store: {exc}") from exc
            return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


class Pulse:
    """Mixed into Flower's handlers: the store call off the loop, filters, who acts."""

    if TYPE_CHECKING:  # what Flower's BaseHandler (a RequestHandler) provides
        application: Any
        request: Any

        def get_argument(self, name: str, default: Any = None, strip: bool = True,
                         type: Any = None, required: bool = False, escape: bool = True
                         ) -> Any: ...

        def get_arguments(self, name: str, strip: bool = True) -> list[str]: ...

    @property
    def pulse(self) -> PulseContext:
        context: PulseContext = self.application.settings["pulse"]
        return context

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(store, *args)`` on Flower's executor; store errors become HTTP errors."""
        def run() -> T:
            return fn(self.pulse.store(), *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        except PulseError as exc:
            raise as_http_error(exc) from exc

    def arg(self, name: str) -> str | None:
        """One query/form value, as given (Flower's own escaping is for its search)."""
        value = self.get_argument(name, None, escape=False)
        return value if value else None

    def claim_query(self, *, default_limit: int = 50, states: tuple[str, ...] = ()) -> ClaimQuery:
        """The claim filter of this request; unknown names or values are a 400."""
        self.known_params(FILTERS)
        given = [s.strip() for v in self.get_arguments("state") for s in v.split(",")
                 if s.strip()]
        unknown = [s for s in given if s not in CLAIM_STATES]
        if unknown:
            raise web.HTTPError(400, f"unknown state {', '.join(map(repr, unknown))}; valid "
                                     f"states: {', '.join(CLAIM_STATES)}")
        limit_text = self.arg("limit")
        try:
            limit = default_limit if limit_text is None else int(limit_text)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIMIT:
            raise web.HTTPError(400, f"limit must be an integer from 1 to {MAX_LIMIT}, "
                                     f"got {limit_text!r}")
        return ClaimQuery(states=tuple(dict.fromkeys(given)) or states, queue=self.arg("queue"),
                          task_name=self.arg("task"), worker=self.arg("worker"), limit=limit,
                          after=self.arg("after"))

    #: What every GET of this kind of handler also takes (a page's, or the API's).
    extra_params: tuple[str, ...] = ()

    def known_params(self, known: tuple[str, ...] = ()) -> None:
        """A parameter this GET does not take is a 400 naming the ones it does."""
        known = known + self.extra_params
        unknown = sorted(set(self.request.arguments) - set(known))
        if unknown:
            raise web.HTTPError(400, f"unknown parameter {', '.join(map(repr, unknown))}; "
                                     f"valid parameters: {', '.join(known)}")

    def who(self) -> str:
        """Who acts, as the audit records it: the Flower user, then where they came from."""
        user = getattr(self, "current_user", None)
        if not isinstance(user, str):
            user = basic_auth_user(self.request.headers.get("Authorization", ""))
        return f"{user or 'anonymous'}@{self.request.remote_ip} (flower on " \
               f"{getpass.getuser()}@{socket.gethostname()})"

    def refuse_writes_if_read_only(self) -> None:
        """Flower's ``--read_only`` turns pulse's actions off too (a 403, nothing changed)."""
        if self.request.method == "POST" and self.application.options.read_only:
            raise web.HTTPError(403, "Read only mode is enabled: Flower was started with "
                                     "--read_only, pulse's actions are off")

    def require_browser_xsrf(self) -> None:
        """A browser's POST carries the XSRF token (see the module's docstring)."""
        headers = self.request.headers
        if headers.get("Cookie") or headers.get("Origin") or headers.get("Sec-Fetch-Site"):
            web.RequestHandler.check_xsrf_cookie(self)  # type: ignore[arg-type]


def flash(message: str, level: str) -> str:
    """The query string that shows ``message`` on the page an action redirects to."""
    return urlencode({"message": message, "level": level})


def basic_auth_user(header: str) -> str | None:
    """The user name of a ``Basic`` Authorization header (Flower checked the password)."""
    import base64
    import binascii

    kind, _, value = header.partition(" ")
    if kind != "Basic" or not value:
        return None
    try:
        return base64.b64decode(value.strip()).decode().partition(":")[0] or None
    except (binascii.Error, UnicodeDecodeError):
        return None


def as_http_error(exc: PulseError) -> web.HTTPError:
    """Pulse's errors as the API answers them: bad input 400, moved on 409, missing 404."""
    if isinstance(exc, Moved):
        return web.HTTPError(409, str(exc))
    if isinstance(exc, NotFound):
        return web.HTTPError(404, str(exc))
    if isinstance(exc, InvalidConfig):
        return web.HTTPError(400, str(exc))
    return web.HTTPError(503, f"pulse store: {exc}")


def state_colour(state: str) -> str:
    """The Bootstrap colour of a claim state's badge."""
    return {RESERVED: "info", RUNNING: "primary", OPEN: "secondary", SUCCEEDED: "success",
            FAILED: "danger", NEEDS_REVIEW: "warning", REVOKED: "dark"}.get(state, "light")


class PageHandler(Pulse, BaseHandler):
    """A pulse page: Flower's page handler, its templates, auth and XSRF."""

    extra_params = PAGE_PARAMS

    def prepare(self) -> None:
        super().prepare()
        self.refuse_writes_if_read_only()

    def check_xsrf_cookie(self) -> None:
        super().check_xsrf_cookie()
        self.require_browser_xsrf()

    def render_page(self, template: str, **values: Any) -> None:
        self.render(template, message=self.arg("message"), level=self.arg("level") or "info",
                    iso=iso, state_colour=state_colour, page_url=self.page_url,
                    read_only=bool(self.application.options.read_only), **values)

    def page_url(self, **replace: str | None) -> str:
        """This page's URL with some arguments replaced (None drops one), e.g. the cursor."""
        args = {k: v[-1].decode() for k, v in self.request.query_arguments.items()
                if k not in ("message", "level")}
        args.update(replace)
        kept = {k: v for k, v in args.items() if v}
        path: str = self.request.path
        return path + ("?" + urlencode(kept) if kept else "")


class ApiHandler(Pulse, BaseApiHandler):
    """A pulse API endpoint: Flower's API handler (``FLOWER_UNAUTHENTICATED_API`` and all)."""

    extra_params = API_PARAMS

    def prepare(self) -> None:
        super().prepare()
        self.refuse_writes_if_read_only()

    def check_xsrf_cookie(self) -> None:
        super().check_xsrf_cookie()
        self.require_browser_xsrf()

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Errors as JSON: ``{"error": ..., "status": ...}`` (Flower's are plain text)."""
        exc = kwargs.get("exc_info", (None, None))[1]
        message = exc.log_message if isinstance(exc, web.HTTPError) and exc.log_message \
            else self._reason
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.finish({"error": message, "status": status_code})
