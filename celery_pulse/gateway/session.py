"""The gateway's session rules (seed 003 §3), with no I/O: who a connection is, which
of its sessions is current, what its declared capacity is, and which operations it has
already made.

The rules, before any code:

* **Identity.** A worker process is an *instance* (``instance_id``), proved by its
  ``instance_secret`` (kept only as a digest). A reconnect must present the same
  credential, queue, capability set (in any order) and secret; anything else is refused,
  so knowing an instance id (or a task id) never takes a worker over. A process that
  restarts uses a new instance id.
* **Generations.** Each accepted hello opens a new session of its instance, one
  generation (``epoch``) higher; the instance's earlier session is invalid from that
  moment: every frame it still sends is refused with ``SESSION_MISMATCH``, and its
  connection is closed.
* **Capacity.** Dispatch starts only after the first ``worker.capacity``. Updates carry
  a sequence that only grows and overwrite the value: the same sequence with the same
  content is a repeat (answered again), the same sequence with other content, or an
  older one, is ``STATE_CONFLICT``. ``drain=true`` is for the whole instance, kept
  across reconnects, and can't be cleared (``STATE_CONFLICT``). ``capacity=0`` stops new
  dispatch; it frees nothing the instance holds.
* **Idempotency.** An operation is named by its ``message_id`` for the instance's life,
  across its sessions: the same id with the same content is answered with the original
  reply, marked ``deduplicated``; the same id with other content is
  ``IDEMPOTENCY_CONFLICT``. The memory of replies is bounded (oldest forgotten first).

This is one gateway's view; the store's is the truth every gateway shares
(:mod:`celery_pulse.store.gateway_state`): who owns an instance id
(``CredentialStore.bind_instance``), its generation, identity and capacity (the server
opens the session there before :meth:`Sessions.hello`), and the attempts it was assigned
(an attempt this gateway never saw is looked up there, :meth:`Instance.adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from celery_pulse.gateway.frames import Code, Hello, ProtocolError
from celery_pulse.store.credentials import digest
from celery_pulse.store.gateway_state import Opened

#: Replies remembered per instance for deduplication.
REPLIES_KEPT = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """What a reconnect of an instance must present again."""

    credential_id: str
    queue_id: str
    capabilities: frozenset[Any]
    secret_digest: str

    @classmethod
    def of(cls, credential_id: str, hello: Hello) -> Identity:
        return cls(credential_id, hello.queue_id, hello.capabilities,
                   digest(hello.instance_secret))


@dataclasses.dataclass(frozen=True, slots=True)
class CapacityState:
    sequence: int = -1
    capacity: int = 0
    drain: bool = False
    #: Set once the first ``worker.capacity`` is accepted: dispatch may begin.
    declared: bool = False


#: Attempt states as the seed names them: granted, not started / started.
LEASED, RUNNING, FINISHED = "LEASED", "RUNNING", "FINISHED"
LIVE = (LEASED, RUNNING)
#: Attempts remembered per instance: a late finish of one still reaches the store (which
#: keeps it as evidence) instead of being answered NOT_FOUND.
ATTEMPTS_KEPT = 1024


@dataclasses.dataclass
class Attempt:
    """One grant the gateway assigned to an instance (``task.assign``).

    ``task_id`` is the Celery task id (the claim's key); ``wire_task_id`` the 32-hex id the
    protocol names it by. ``deadline`` is on this host's monotonic clock: the time after
    which the gateway stops counting it against the instance's capacity (it may be
    Recover's by then); it is never compared with a store timestamp.
    """

    task_id: str
    wire_task_id: str
    attempt_id: str
    epoch: int
    token: str
    task_name: str
    lease_until: float
    deadline: float
    state: str = LEASED
    #: The token's digest, for an attempt adopted from the store before any frame
    #: proved its token (``token`` is empty until then).
    token_digest: str = ""
    #: Its start was answered WAITING (no free concurrency permit): still LEASED (not
    #: started), but renewed like a running one while it waits.
    waiting: bool = False


@dataclasses.dataclass
class Session:
    """One connection's standing: the instance it speaks for, under which generation."""

    session_id: str
    instance_id: str
    epoch: int
    hello_capacity: int


class Instance:
    """One worker process as the gateway knows it, across its connections."""

    def __init__(self, instance_id: str, identity: Identity) -> None:
        self.instance_id = instance_id
        self.identity = identity
        self.epoch = 0
        self.current: Session | None = None
        self.capacity = CapacityState()
        #: Guards ``attempts`` and ``capacity``: the feeder thread asks :meth:`free`.
        self.lock = threading.Lock()
        #: attempt_id -> the attempts assigned to it, oldest first (across sessions).
        self.attempts: dict[str, Attempt] = {}
        #: Those of them that may still be live (a superset, pruned by :meth:`free`): the
        #: feeder asks for the free slots on every look, and ``attempts`` keeps 1,024.
        self._live: dict[str, Attempt] = {}
        self._replies: OrderedDict[str, tuple[str, Mapping[str, Any]]] = OrderedDict()
        self._applying: dict[str, tuple[str, asyncio.Future[Any]]] = {}

    def open(self, session_id: str, hello_capacity: int, opened: Opened) -> Session:
        """The generation the store just opened: the previous session (if any) stops
        being current, and the capacity is the instance's as the store has it."""
        self.epoch = opened.generation
        self.current = Session(session_id, self.instance_id, self.epoch, hello_capacity)
        if opened.capacity_sequence > self.capacity.sequence:
            with self.lock:
                self.capacity = CapacityState(opened.capacity_sequence, opened.capacity,
                                              opened.drain, declared=self.capacity.declared)
        return self.current

    def is_current(self, session: Session) -> bool:
        return self.current is session

    def close(self, session: Session) -> None:
        if self.current is session:
            self.current = None

    def declare(self, sequence: int, capacity: int, drain: bool) -> CapacityState:
        """Apply one ``worker.capacity`` (see the module's rules)."""
        now = self.capacity
        if sequence == now.sequence:
            if (capacity, drain) != (now.capacity, now.drain):
                raise ProtocolError(Code.STATE_CONFLICT,
                                    "this capacity sequence was declared with other values")
            if not now.declared:  # the store's, declared through another gateway
                with self.lock:
                    self.capacity = now = dataclasses.replace(now, declared=True)
            return now
        if sequence < now.sequence:
            raise ProtocolError(Code.STATE_CONFLICT,
                                f"capacity sequence {sequence} is older than {now.sequence}")
        if now.drain and not drain:
            raise ProtocolError(Code.STATE_CONFLICT,
                                "this instance is draining: drain can't be cleared")
        with self.lock:
            self.capacity = CapacityState(sequence, capacity, drain, declared=True)
        return self.capacity

    def free(self, now: float) -> int:
        """Slots dispatch may fill now: declared capacity minus the attempts held (one
        past its local deadline no longer counts: it may be Recover's by then); 0 while
        draining or undeclared."""
        with self.lock:
            state = self.capacity
            if not state.declared or state.drain:
                return 0
            live = self._live
            for attempt_id in [i for i, a in live.items() if a.state not in LIVE]:
                del live[attempt_id]
            held = sum(1 for a in live.values() if a.deadline > now)
            return max(0, state.capacity - held)

    def assign(self, attempt: Attempt) -> None:
        with self.lock:
            self.attempts[attempt.attempt_id] = attempt
            self._live[attempt.attempt_id] = attempt
            while len(self.attempts) > ATTEMPTS_KEPT:  # the oldest: finished or expired
                self._live.pop(self.attempts.pop(next(iter(self.attempts))).attempt_id, None)

    def attempt(self, wire_task_id: str, attempt_id: str, epoch: int, secret: str) -> Attempt:
        """The attempt a frame names, if it names it exactly (secret compared in constant
        time); ``NOT_FOUND`` otherwise, whichever part is wrong."""
        found = self.attempts.get(attempt_id)
        if found is None or not matches(found, wire_task_id, epoch, secret):
            raise ProtocolError(Code.NOT_FOUND, "no such attempt for this instance")
        found.token = secret
        return found

    def adopt(self, attempts: list[Attempt], live: set[str] | None = None) -> None:
        """Attempts the store knows and this gateway may not (another gateway assigned
        them): counted from now on. ``live``: every attempt id the store still holds for
        the instance; a local one not among them has ended elsewhere."""
        with self.lock:
            for attempt in attempts:
                known = self.attempts.get(attempt.attempt_id)
                if known is None:
                    self.attempts[attempt.attempt_id] = known = attempt
                else:
                    known.state = attempt.state
                if known.state in LIVE:
                    self._live[known.attempt_id] = known
            if live is not None:
                for attempt_id, known in self.attempts.items():
                    if known.state in LIVE and attempt_id not in live:
                        known.state = FINISHED

    def replay(self, message_id: str, digest: str) -> Mapping[str, Any] | None:
        """The reply already given to ``message_id`` (None: a new operation)."""
        seen = self._replies.get(message_id)
        if seen is None:
            return None
        if not hmac.compare_digest(seen[0], digest):
            raise ProtocolError(Code.IDEMPOTENCY_CONFLICT,
                                "this message_id was used for another operation")
        self._replies.move_to_end(message_id)
        return seen[1]

    def in_flight(self, message_id: str, digest: str) -> asyncio.Future[Any] | None:
        """The answer-to-be of ``message_id`` if it is being applied right now."""
        seen = self._applying.get(message_id)
        if seen is None:
            return None
        if not hmac.compare_digest(seen[0], digest):
            raise ProtocolError(Code.IDEMPOTENCY_CONFLICT,
                                "this message_id was used for another operation")
        return seen[1]

    @contextlib.contextmanager
    def applying(self, message_id: str, digest: str) -> Iterator[asyncio.Future[Any]]:
        """While ``message_id`` is applied: a repeat waits for its answer (a failure is
        passed on to it as the exception)."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._applying[message_id] = (digest, done)
        try:
            yield done
        except BaseException as exc:
            if not done.done():
                done.set_exception(exc if isinstance(exc, ProtocolError) else ProtocolError(
                    Code.INTERNAL, "the operation did not complete"))
                done.exception()  # retrieved: a repeat may never come
            raise
        finally:
            self._applying.pop(message_id, None)

    def remember(self, message_id: str, digest: str, reply: Mapping[str, Any]) -> None:
        self._replies[message_id] = (digest, reply)
        while len(self._replies) > REPLIES_KEPT:
            self._replies.popitem(last=False)


def matches(attempt: Attempt, wire_task_id: str, epoch: int, secret: str) -> bool:
    """Whether a frame's reference names ``attempt`` (its secret in constant time)."""
    proof = (hmac.compare_digest(attempt.token, secret) if attempt.token
             else hmac.compare_digest(attempt.token_digest, digest(secret)))
    return attempt.wire_task_id == wire_task_id and attempt.epoch == epoch and proof


class Sessions:
    """Every instance this gateway knows, and the hello that opens a session."""

    def __init__(self, on_replaced: Callable[[Session], None] | None = None) -> None:
        self._instances: dict[str, Instance] = {}
        self._on_replaced = on_replaced

    def hello(self, credential_id: str, hello: Hello, session_id: str, opened: Opened
              ) -> tuple[Instance, Session]:
        """Open the session the store opened (``opened``) for ``hello`` here (a new
        instance to this gateway, or a reconnect of a known one)."""
        identity = Identity.of(credential_id, hello)
        instance = self._instances.get(hello.instance_id)
        if instance is None:
            instance = self._instances[hello.instance_id] = Instance(hello.instance_id, identity)
        elif not hmac.compare_digest(instance.identity.secret_digest, identity.secret_digest):
            raise ProtocolError(Code.UNAUTHENTICATED,
                                "this instance id is held by another process")
        elif instance.identity != identity:
            raise ProtocolError(
                Code.STATE_CONFLICT,
                "a reconnect must keep its credential, queue and capabilities")
        previous = instance.current
        session = instance.open(session_id, hello.capacity, opened)
        if previous is not None and self._on_replaced is not None:
            self._on_replaced(previous)
        return instance, session

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def instances(self) -> list[Instance]:
        return list(self._instances.values())

    def __len__(self) -> int:
        return len(self._instances)
