"""What runs inside a pool child: expose the lease, cancel the body on loss.

The parent wraps each leased job's target in :func:`run_leased`, and hands the job
over only once the store has moved the claim to ``running`` (the start is batched by
the worker) — except under Celery's synchronous loop, where the child authorises the
start itself (``start_in_child``). In the child it:

1. checks the lease is still held (the shared deadline table): lost meanwhile -> the
   body never runs, and the parent drops the job;
2. makes the lease visible to the task (``current_lease()``);
3. arms a ``SIGUSR2`` handler: when the parent revokes the lease, the handler raises
   :class:`LeaseLost` — but only while the task's own code is on the stack, never
   inside Celery's tracer after the body (that must finish recording the outcome).
   Raised so that a database call it lands in is cancelled on the server, and the
   process is replaced after the job (:mod:`~celery_pulse.pool.interrupt`);
4. guards the task's result backend: a stale attempt (its lease lost) never writes its
   state there, so a chord counts, and ``AsyncResult.get()`` sees, only the attempt
   that holds the lease. The lease is checked right before each write, so the window
   is one local check wide;
5. says, in one WARNING line, what became of a task whose lease was lost (who held it at
   which epoch, who holds it now): Celery's own line for that failure is its "raised
   expected" INFO line, without a traceback (``LeaseLost`` is in the task's ``throws``),
   since a stale attempt stopping is the design working, not a bug;
6. with the ``pulse://`` backend, keeps the attempt's outcome instead of writing it and
   returns it with the tracer's result (:data:`RECORDED`): the parent writes it in the
   completion's transaction, fenced by the store (no window at all, no SQL here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import weakref
from types import CodeType, FrameType
from typing import Any

from celery_pulse.backend import carried_by_completions, deferred_result, record_fields
from celery_pulse.errors import LeaseLost, PulseError
from celery_pulse.lease import Lease, current_lease, set_current
from celery_pulse.pool import checkpointing, interrupt
from celery_pulse.pool.slots import DeadlineTable
from celery_pulse.settings import Settings
from celery_pulse.store.base import LIVE_STATES, OPEN
from celery_pulse.store.sql.fence import make_fencer
from celery_pulse.store.sql.holders import holding_of

logger = logging.getLogger(__name__)

LEASE_SIGNAL = signal.SIGUSR2
REFUSED = "celery-pulse:start-refused"
#: ``(RECORDED, tracer's return, ResultRecord's fields or None, chord part or None,
#: messages published or None)``: the attempt's result for the ``pulse://`` backend,
#: written (and a chord part counted) by the parent with the completion (fenced), not by
#: the child; and what a gateway worker's attempt published, carried with it.
RECORDED = "celery-pulse:result"
#: Result-backend methods Celery's tracer writes a task's state through.
BACKEND_WRITES = ("store_result", "mark_as_done", "mark_as_failure", "mark_as_retry",
                  "mark_as_revoked", "mark_as_started")


@dataclasses.dataclass
class ChildContext:
    """Set in the parent before the children fork; inherited by every child."""

    app: Any
    store_url: str
    holder: str
    ttl: float
    table: DeadlineTable
    #: The worker's settings: they shape the child's own engine (role ``child``).
    settings: Settings | None = None


_context: ChildContext | None = None
_store: Any = None
_fence: Any = None
_armed: tuple[Lease, frozenset[CodeType]] | None = None
_codes: dict[str, frozenset[CodeType]] = {}
#: Result backends whose writes are guarded in this process.
_guarded: weakref.WeakSet[Any] = weakref.WeakSet()
#: Result backends whose results the parent's completions write (:func:`_carried`).
_carries: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def configure(context: ChildContext) -> None:
    """Called in the parent (before fork)."""
    global _context, _fence
    _context = context
    _fence = None


def _child_store() -> Any:
    global _store
    if _store is None:
        from celery_pulse.store.sql import store_on
        from celery_pulse.store.sql.engine import EngineOptions, make_engine

        assert _context is not None
        settings = _context.settings
        options = (EngineOptions.of(settings, "child") if settings is not None
                   else EngineOptions(role="child"))
        _store = store_on(make_engine(_context.store_url, options))
    return _store


def _fencer() -> Any:
    global _fence
    if _fence is None:
        assert _context is not None
        _fence = make_fencer(_context.store_url, _context.ttl, _pooler_mode)
    return _fence


def _pooler_mode() -> str:
    """The store's pooler mode, as this process's store engine found it."""
    from celery_pulse.store.sql.pooler import mode_of

    return mode_of(_child_store().engine)


def _checkpointer(slot: int | None) -> checkpointing.SlotCheckpointer | None:
    """The attempt's checkpoints: none on a gateway worker (no SQL store here)."""
    assert _context is not None
    if _context.settings is not None and _context.settings.gateway_url is not None:
        return None
    return checkpointing.SlotCheckpointer(_child_store, _context.holder, _context.ttl,
                                          _context.table.checkpoints, slot)


def _task_codes(name: str) -> frozenset[CodeType]:
    """Code objects whose frames mean "the task body is running"."""
    codes = _codes.get(name)
    if codes is not None:
        return codes
    from celery.app.task import Task

    assert _context is not None
    task = _context.app.tasks.get(name)
    found: set[CodeType] = set()
    for attr in ("run", "__call__"):
        fn = getattr(type(task), attr, None) if attr == "__call__" else getattr(task, attr, None)
        if attr == "__call__" and fn is Task.__call__:
            continue
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            found.add(code)
    codes = _codes[name] = frozenset(found)
    return codes


def _on_lease_signal(signum: int, frame: FrameType | None) -> None:
    armed = _armed
    if armed is None:
        return
    lease, codes = armed
    if not lease.lost:  # a late signal meant for an earlier task in this child
        return
    lease.mark_lost()
    if lease.raised:  # the task is unwinding a LeaseLost already: don't interrupt that
        return
    here = frame
    while frame is not None:
        if frame.f_code in codes:
            raise interrupt.lease_lost(lease, here)
        frame = frame.f_back


def _carried(backend: Any) -> bool:
    """Whether the parent's completion writes ``backend``'s results (asked once per
    backend instance)."""
    if backend is None or _context is None:
        return False
    known = _carries.get(backend)
    if known is None:
        known = _carries[backend] = carried_by_completions(backend, _context.store_url)
    return known


def _guard_backend(backend: Any) -> None:
    """Wrap ``backend``'s writes (once per backend instance) with the lease check."""
    if backend is None or backend in _guarded:
        return
    _guarded.add(backend)  # once, even if it fails half-way (never wrap twice)
    try:
        for name in BACKEND_WRITES:
            method = getattr(backend, name, None)
            if method is not None:
                setattr(backend, name, _unless_lost(method, name))
    except (AttributeError, TypeError):  # a backend that takes no attributes: unguarded
        logger.warning("pulse: cannot guard result backend %r: a stale attempt may write "
                       "its outcome", type(backend).__name__)


def _unless_lost(method: Any, name: str) -> Any:
    @functools.wraps(method)
    def write(*args: Any, **kwargs: Any) -> Any:
        lease = current_lease()
        if lease is not None and lease.lost:
            # INFO: the designed end of a stale attempt, told in the lost-lease WARNING.
            logger.info("pulse: not writing %s for task %s epoch %d to the result "
                        "backend: this attempt lost its lease", name, lease.task_id,
                        lease.epoch)
            return None
        return method(*args, **kwargs)
    return write


def _expect_lease_lost(task: Any) -> None:
    """Put LeaseLost in the task's ``throws``: Celery then logs its failure at INFO, with
    no traceback ("raised expected"); the task still ends FAILURE with LeaseLost."""
    throws = getattr(task, "throws", None)
    if task is None or not isinstance(throws, tuple) or LeaseLost in throws:
        return
    with contextlib.suppress(AttributeError, TypeError):
        task.throws = (*throws, LeaseLost)


#: Seconds the lost-lease line waits to learn who holds the task now. A lease is often
#: lost to a partition, where a read on a pooled connection would wait for TCP to give
#: up: the process must go back to work (or be hard-stopped after the grace) instead.
HOLDER_LOOKUP_S = 1.0


def _now_held(lease: Lease) -> str:
    """Who holds the task now, by the store, for the log line (never decides anything)."""
    found: list[Any] = []

    def look() -> None:
        try:
            found.append(holding_of(_child_store().engine, lease.task_id))
        except Exception as exc:  # a log line's detail: never the task's end
            found.append(exc)

    reader = threading.Thread(target=look, name="pulse-holder-lookup", daemon=True)
    reader.start()
    reader.join(HOLDER_LOOKUP_S)
    if not found:
        return "who holds it now is unknown (the store did not answer in time)"
    holding = found[0]
    if isinstance(holding, Exception):
        return f"who holds it now is unknown (the store did not answer: {holding})"
    if holding is None:
        return "its claim is gone"
    if (holding.holder, holding.epoch) == (lease.holder, lease.epoch):
        return "nobody has taken it over yet"
    if holding.state in (*LIVE_STATES, OPEN) and holding.holder:
        return f"{holding.holder} holds epoch {holding.epoch} ({holding.state})"
    return f"it is {holding.state} at epoch {holding.epoch}"


def _report_lost(lease: Lease, name: str) -> None:
    try:
        logger.warning("pulse: task %s[%s] lost its lease: was held by %s at epoch %d; %s",
                       name, lease.task_id, lease.holder, lease.epoch, _now_held(lease))
    except Exception:  # a log line must never break the pool process
        logger.debug("pulse: could not report the lost lease of %s", lease.task_id,
                     exc_info=True)


def _install_handler() -> None:
    # Checked every time, not remembered: billiard resets "termination" signals
    # (SIGUSR2 among them) in each new child after Celery's process initializer ran,
    # so a handler installed from ``worker_process_init`` does not survive.
    if signal.getsignal(LEASE_SIGNAL) is not _on_lease_signal:
        signal.signal(LEASE_SIGNAL, _on_lease_signal)


def run_leased(target: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``target`` under the lease the parent started for it."""
    global _armed
    request = args[2] if len(args) > 2 and isinstance(args[2], dict) else {}
    info = request.get("pulse")
    if info is None or _context is None:
        return target(*args, **kwargs)
    task_id = info["task_id"]
    _install_handler()  # first: SIGUSR2's default action kills the child
    if info.get("start_in_child"):
        try:
            started = _child_store().start(_context.holder, task_id, info["epoch"],
                                           info["token"], _context.ttl)
        except PulseError:
            started = None
        if started is None:
            return (REFUSED, task_id)
    table, slot = _context.table, info.get("slot")
    lease = Lease(task_id, info["epoch"], info["token"], _context.holder,
                  read_deadline=(lambda: table.read(slot, task_id)) if slot is not None
                  else (lambda: None),
                  fencer=_fencer(),
                  initial_deadline=info["deadline"],
                  checkpointer=_checkpointer(slot))
    if lease.lost:
        # Lost between the start and now (the signal found no task frame to raise
        # in): never start the body. The store decides what happens next (Recover).
        return (REFUSED, task_id)
    _armed = (lease, _task_codes(args[0]))
    set_current(lease)
    task = _context.app.tasks.get(args[0])
    _expect_lease_lost(task)
    backend = None if task is None else task.backend
    _guard_backend(backend)
    try:
        if not _carried(backend):  # another backend, or results in a store of their own
            return interrupt.plain(target(*args, **kwargs))
        with deferred_result(task_id) as deferral:
            value = interrupt.plain(target(*args, **kwargs))
        if deferral.record is not None or deferral.published:
            return (RECORDED, value, None if deferral.record is None
                    else record_fields(deferral.record), deferral.chord, deferral.published)
        return value
    finally:
        _armed = None
        if lease.raised:
            _report_lost(lease, args[0])
        checkpointing.flush(lease)
        set_current(None)
        interrupt.settle()  # an interrupted process is replaced before its next job
