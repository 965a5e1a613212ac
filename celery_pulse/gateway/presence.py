"""Gateway workers in the worker registry: ``pulse workers``, ``pulse status`` and
``pulse claims`` see an instance served by a gateway as they see a direct worker.

The rules, before any code:

* **Name and labels.** An instance is registered under its holder name
  (``gw:<credential>:<instance id>``), the name its claims carry, so a row of
  ``pulse workers`` and the claims it holds read alike. Its labels say ``via: gateway``
  and which gateway, credential, queue and capacity.
* **While a session is current.** Each accepted hello registers the instance (the
  first one, and each reconnect: the registry replaces the registration under a new
  token and keeps its drain flag). It is heartbeated every ``ttl / 3`` with ``ttl``
  the session window. A heartbeat that finds the registration expired (the store was
  out of reach) registers again, unless a live registration with another token holds
  the name: the worker reconnected through another gateway, which keeps it from then
  on, and this one stops beating for it.
* **Leaving.** When the instance's last session ends its registration is removed with
  its own token: a newer registration of the name (another gateway's) is untouched.
* **Drain.** ``drain=true`` in ``worker.capacity`` is the registry's persistent drain
  of the instance's name, as ``pulse drain`` would set it.
* **Never in the way.** One task per registered instance applies these in the order
  they were asked for; each store call runs in a thread under the store deadline (the
  gateway's own runner). A failing call is logged and the session carries on: the
  registry is for operators, the claims fence the work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from celery_pulse.errors import NotRegistered
from celery_pulse.store.base import Registration, RegistryStore, mask_token

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Runner(Protocol):
    """Runs a blocking store call off the event loop, under the store deadline."""

    def __call__(self, call: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


class Presence:
    """Keeps the registry's rows of one gateway's instances (see the module's rules)."""

    def __init__(self, store: RegistryStore, run: Runner, *, ttl: float, gateway: str) -> None:
        self.store, self.run = store, run
        self.ttl, self.interval = ttl, ttl / 3
        #: This gateway as its instances' labels name it (``host:pid``).
        self.gateway = gateway
        #: worker id -> (its operations waiting, the task applying them).
        self._members: dict[str, tuple[asyncio.Queue[_Op], asyncio.Task[None]]] = {}

    def labels(self, credential: str, queue: str, capacity: int) -> dict[str, Any]:
        return {"via": "gateway", "gateway": self.gateway, "credential": credential,
                "queue": queue, "capacity": capacity}

    def arrive(self, worker_id: str, labels: Mapping[str, Any]) -> None:
        """A session of ``worker_id`` became current: (re)register it."""
        self._ask(worker_id, _Op("arrive", labels=dict(labels)))

    def drain(self, worker_id: str, who: str) -> None:
        self._ask(worker_id, _Op("drain", who=who))

    async def leave(self, worker_id: str) -> None:
        """Its last session ended: deregister it (returns once done, or given up)."""
        if worker_id not in self._members:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = self._ask(worker_id, _Op("leave", done=done))
        await asyncio.wait((done, task), return_when=asyncio.FIRST_COMPLETED)

    # -- one instance's task ------------------------------------------------------
    def _ask(self, worker_id: str, op: _Op) -> asyncio.Task[None]:
        member = self._members.get(worker_id)
        if member is None:
            inbox: asyncio.Queue[_Op] = asyncio.Queue()
            member = self._members[worker_id] = (inbox, asyncio.create_task(
                self._keep(worker_id, inbox), name=f"pulse-presence-{worker_id}"))
        member[0].put_nowait(op)
        return member[1]

    async def _keep(self, worker_id: str, inbox: asyncio.Queue[_Op]) -> None:
        try:
            await self._apply(worker_id, inbox)
        except Exception:  # a bug here must not leave a dead task taking requests
            logger.exception("pulse gateway: keeping %s registered failed", worker_id)
        finally:
            # Reached with no await since the inbox was last seen empty: no request can
            # slip past it (the next one starts a new task).
            del self._members[worker_id]

    async def _apply(self, worker_id: str, inbox: asyncio.Queue[_Op]) -> None:
        """The instance's requests in order, and its heartbeats while it is wanted."""
        loop = asyncio.get_running_loop()
        registration: Registration | None = None
        #: The labels while a session is current (the name is wanted), else None.
        wanted: dict[str, Any] | None = None
        beat_at = 0.0
        while True:
            wait = None if wanted is None else max(0.0, beat_at - loop.time())
            try:
                op = await asyncio.wait_for(inbox.get(), wait)
            except TimeoutError:
                assert wanted is not None
                registration, held = await self._beat(worker_id, registration, wanted)
                wanted = wanted if held else None
                beat_at = loop.time() + self.interval
            else:
                try:
                    if op.kind == "arrive":
                        wanted = op.labels
                        got = await self._register(worker_id, wanted, replace_live=True)
                        registration = got if isinstance(got, Registration) else None
                        beat_at = loop.time() + self.interval
                    elif op.kind == "drain":
                        await self._attempt("drain", worker_id, self.store.set_drain,
                                            worker_id, True, op.who)
                    else:
                        if registration is not None:
                            await self._attempt("deregister", worker_id,
                                                self.store.deregister, worker_id,
                                                registration.token)
                        registration = wanted = None
                finally:
                    if op.done is not None and not op.done.done():
                        op.done.set_result(None)
            if wanted is None and inbox.empty():
                return  # nothing wanted and nothing asked

    async def _register(self, worker_id: str, labels: Mapping[str, Any], *,
                        replace_live: bool) -> Registration | NotRegistered | None:
        """The registration; NotRegistered if another process holds the name (only
        with ``replace_live=False``); None if the call failed."""
        call = functools.partial(self.store.register, replace_live=replace_live)
        got = await self._attempt("register", worker_id, _caught(call), worker_id, labels,
                                  self.ttl)
        if isinstance(got, Registration):
            logger.info("pulse gateway: registered %s (token %s, ttl %gs)", worker_id,
                        mask_token(got.token), self.ttl)
        return got

    async def _beat(self, worker_id: str, registration: Registration | None,
                    labels: Mapping[str, Any]) -> tuple[Registration | None, bool]:
        """One heartbeat: the registration now, and whether the name is still ours to
        keep (False once another process registered it)."""
        if registration is not None:
            answer = await self._attempt("heartbeat", worker_id,
                                         _caught(self.store.heartbeat), worker_id,
                                         registration.token, self.ttl)
            if not isinstance(answer, NotRegistered):
                return registration, True  # beaten, or failed: the next beat tries again
            if answer.reason == NotRegistered.REPLACED:
                logger.info("pulse gateway: %s was registered by another process; no "
                            "longer keeping it registered here", worker_id)
                return None, False
        # Expired or missing (or never granted: the arrival's call failed): take the name
        # back, but never from a live registration of another process.
        got = await self._register(worker_id, labels, replace_live=False)
        if isinstance(got, NotRegistered):
            logger.info("pulse gateway: %s is registered by another process; not keeping "
                        "it registered here", worker_id)
            return None, False
        return got, True

    async def _attempt(self, what: str, worker_id: str, call: Callable[..., T], *args: Any
                       ) -> T | None:
        """``call`` through the runner; None (after a warning) if it failed."""
        try:
            return await self.run(call, *args)
        except Exception as exc:  # the registry must never end a session
            logger.warning("pulse gateway: registry %s of %s failed: %s", what, worker_id,
                           exc)
            return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Op:
    """One request to an instance's task: ``arrive``, ``drain`` or ``leave``."""

    kind: str
    labels: dict[str, Any] = dataclasses.field(default_factory=dict)
    who: str = ""
    #: Set once a ``leave`` is applied (or given up).
    done: asyncio.Future[None] | None = None


def _caught(call: Callable[..., T]) -> Callable[..., T | NotRegistered]:
    """``call``, answering :class:`NotRegistered` instead of raising it: its reason
    decides what happens next, and the runner would turn it into a generic failure."""

    def caught(*args: Any) -> T | NotRegistered:
        try:
            return call(*args)
        except NotRegistered as exc:
            return exc

    caught.__name__ = getattr(call, "__name__", "registry call")
    return caught

