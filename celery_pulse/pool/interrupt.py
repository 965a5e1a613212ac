"""A lost lease's interruption of a body that may be inside a database call.

The lease signal raises LeaseLost wherever the body is, often inside a driver waiting
for the server. Raised as a plain exception there, it left the statement running on
the server and the connection mid-command: measured, the next five tasks on that
process failed with psycopg's "another command is already in progress", and under
SQLAlchemy the rollback on the way out failed, so the task ended ``OperationalError``.
So, in a pool child:

- the LeaseLost the signal raises is also a ``KeyboardInterrupt``
  (:class:`LeaseLost` here): a driver cleans up as on Ctrl-C. psycopg 3 then cancels
  the statement on the server and waits for it to end (at most 5 s each), so the
  connection is idle again and a rollback on the way out works;
- a PyMySQL connection found on the interrupted stack gets ``KILL QUERY`` from a side
  connection (PyMySQL closes its own on any interruption, but the server would go on
  running the statement);
- the tracer's result carries a plain :class:`celery_pulse.LeaseLost` (:func:`plain`);
- the process is replaced before its next job (:func:`settle`): whatever the body
  left behind (a module-level connection, a lock, half-written state) can't be proved
  clean, and one lost lease must never fail another task.
"""

from __future__ import annotations

import logging
import threading
from types import FrameType
from typing import Any

from celery_pulse import errors
from celery_pulse.lease import Lease

logger = logging.getLogger(__name__)

#: Seconds a side connection gets to deliver ``KILL QUERY`` before the job's end is
#: reported anyway (a lease is often lost to a partition).
KILL_TIMEOUT_S = 2.0


class LeaseLost(errors.LeaseLost, KeyboardInterrupt):
    """:class:`celery_pulse.LeaseLost`, raised by the lease signal: also a
    ``KeyboardInterrupt``, which database drivers answer by cancelling the statement.

    An ``Exception`` first: Celery's tracer, ``except Exception`` and
    ``except LeaseLost`` catch it as before, and its name is still ``LeaseLost``.
    """


#: Set when the signal raised into the body in this process: it is replaced after the job.
_interrupted = False
#: ``KILL QUERY`` side connections started for the current job.
_killers: list[threading.Thread] = []


def lease_lost(lease: Lease, frame: FrameType | None) -> LeaseLost:
    """The LeaseLost to raise into the body at ``frame``; starts the statement's cancel."""
    global _interrupted
    _interrupted = True
    error = lease.lost_error()
    try:
        for conn in _mysql_connections(frame):
            killer = threading.Thread(target=_kill_query, args=_kill_target(conn),
                                      daemon=True, name="pulse-kill-query")
            killer.start()
            _killers.append(killer)
    except Exception as exc:  # never instead of the LeaseLost
        logger.warning("pulse: cannot cancel the statement of a task whose lease was "
                       "lost: %r", exc)
    return LeaseLost(*error.args)


def _mysql_connections(frame: FrameType | None) -> list[Any]:
    """The PyMySQL connections whose methods are on the stack (the one waiting for the
    server among them)."""
    found: list[Any] = []
    while frame is not None:
        if frame.f_globals.get("__name__") == "pymysql.connections":
            conn = frame.f_locals.get("self")
            if type(conn).__name__ == "Connection" and all(conn is not c for c in found):
                found.append(conn)
        frame = frame.f_back
    return found


def _kill_target(conn: Any) -> tuple[int, dict[str, Any]]:
    """The server thread to kill and how to reach its server, read now: PyMySQL forgets
    its socket as the interruption unwinds through it."""
    user = conn.user.decode() if isinstance(conn.user, bytes) else conn.user
    # TLS as the task's connection had it: its context where it was required, else
    # PyMySQL's default (TLS if the server offers it).
    tls = {"ssl": conn.ctx} if getattr(conn, "_ssl_required", False) else {}
    return int(conn.thread_id()), {"host": conn.host, "port": conn.port, "user": user,
                                   "password": conn.password,
                                   "unix_socket": conn.unix_socket, **tls}


def _kill_query(thread_id: int, server: dict[str, Any]) -> None:
    """``KILL QUERY`` the statement of server thread ``thread_id``, from a connection of
    its own."""
    try:
        import pymysql

        side = pymysql.connect(connect_timeout=KILL_TIMEOUT_S, **server)
        try:
            with side.cursor() as cursor:
                cursor.execute(f"KILL QUERY {int(thread_id)}")
        finally:
            side.close()
    except Exception as exc:  # the statement then ends when the server notices
        logger.warning("pulse: could not cancel the statement of a task whose lease was "
                       "lost (KILL QUERY %d): %s", thread_id, exc)


def plain(traced: Any) -> Any:
    """The tracer's ``(failed, einfo, runtime)`` with this module's LeaseLost turned back
    into :class:`celery_pulse.LeaseLost` before it leaves the process.

    Celery's parent re-raises a ``KeyboardInterrupt`` it finds in a result (as its own
    Ctrl-C), so the interruption's class must not reach it; the task's end is LeaseLost.
    So is the end of a body whose cleanup failed on the interrupted connection (PyMySQL
    closes it, and SQLAlchemy's rollback on the way out raises ``InterfaceError`` with
    the LeaseLost as its context): what the body met after the interruption is its
    consequence.
    """
    if not (isinstance(traced, tuple) and len(traced) == 3 and traced[0]):
        return traced
    einfo = traced[1]
    wrapped: Any = getattr(einfo, "exception", None)
    exc = getattr(wrapped, "exc", wrapped)
    lost = _interruption(exc) if _interrupted else None
    if lost is not None:
        replaced = errors.LeaseLost(*lost.args)
        if wrapped is exc:
            einfo.exception = replaced
        else:
            wrapped.exc = replaced
        einfo.type = errors.LeaseLost
    return traced


def _interruption(exc: BaseException | None) -> LeaseLost | None:
    """The lease signal's LeaseLost that ``exc`` is, or arose while handling."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LeaseLost):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def settle() -> None:
    """After the job: let the cancels finish (bounded), and have an interrupted process
    replaced before its next job."""
    global _interrupted
    for killer in _killers:
        killer.join(KILL_TIMEOUT_S)
    _killers.clear()
    if _interrupted:
        _interrupted = False
        if not _recycle():
            logger.warning("pulse: a task was interrupted by a lost lease and this pool "
                           "process could not be replaced: it goes on serving tasks")


def _recycle() -> bool:
    """Ask billiard to end this pool process before it reads its next job.

    billiard's own per-process restart: a pool built with ``allow_restart`` gives each
    process an event its job loop checks before reading a job; set, the process exits
    cleanly (the result just sent is consumed first) and the pool starts a new one, as
    after ``max_tasks_per_child``. A job the parent wrote to it meanwhile goes to
    another process.
    """
    from billiard.process import current_process

    worker = getattr(current_process(), "_target", None)
    sentinel = getattr(worker, "_shutdown", None)
    if sentinel is None:
        return False
    sentinel.set()
    return True
