"""How many connections a process of pulse opens to the store, and what each is called.

The rules (stated in ``docs/production.md``, checked on a real worker by
``tests/acceptance/test_connections.py``):

* Every engine's pool is bounded and never overflows: ``pool_size`` connections at most
  (``pulse_store_pool_size``; a pool child: :data:`CHILD_POOL_SIZE`; the ``pulse://``
  backend in a client: see :func:`pool_arguments`), opened when first needed and kept.
  The parent's threads share them (renewals, the exchanges that leave the pipeline, the
  registry heartbeat, Recover, the leader, the beat, retention, metrics): a statement
  holds a connection for milliseconds, so a thread that finds them all busy waits.
* That wait is bounded by :func:`pool_timeout`: half a renewal interval, at most
  :data:`POOL_TIMEOUT_S`. Past it the call fails with ``StoreUnavailable`` (the exchange is
  retried at the next tick) instead of SQLAlchemy's 30 s default, which inside the renew
  loop would let leases expire (the TTL is three renewal intervals).
* Two connections of a worker's parent live as long as it does (on PostgreSQL only: the
  hot path's pipeline and the permit signals' LISTEN): they are taken out of the pool
  for good (``detach``), the *dedicated* connections, never counted against
  ``pool_size``, so they never starve the threads. A ``pulse://`` result wait
  (``AsyncResult.get()``) LISTENs on a pooled connection and reads on that same one: a
  waiter holds one connection, so a pool of N serves N waiting threads.
* Each connection says what it is: PostgreSQL's ``application_name`` (as libpq's
  ``fallback_application_name``: an ``application_name`` in the URL or ``PGAPPNAME``
  wins) and PyMySQL's ``program_name`` connect attribute read
  ``pulse:<role>:<pid>@<host>``, so ``pg_stat_activity`` (or
  ``performance_schema.session_connect_attrs``) counts them per process and role.
"""

from __future__ import annotations

import os
import socket
from typing import Any

#: The roles a process opens its engine for (``EngineOptions.role``).
ROLES = ("worker", "child", "cli", "beat", "flower", "backend", "gateway")
#: A pool child's store: the start of a task under Celery's synchronous loop, the
#: holder of a lost lease for its log line, one at a time. The task's fence uses the
#: app's own connection, never this one.
CHILD_POOL_SIZE = 1
DEFAULT_POOL_SIZE = 4
#: A gateway applies the operations of every worker it serves side by side, each a
#: statement of its own, and runs a feeder per worker: its pool is at least this.
GATEWAY_POOL_SIZE = 16
#: The longest a thread waits for a pooled connection (see the module doc).
POOL_TIMEOUT_S = 5.0
#: The ``backend`` role's pool: waiters beyond ``pulse_store_pool_size``, and their wait.
BACKEND_OVERFLOW = 8
BACKEND_POOL_TIMEOUT_S = 30.0
#: The longest name PostgreSQL keeps (NAMEDATALEN - 1); the server truncates the rest.
NAME_LIMIT = 63


def pool_arguments(role: str, pool_size: int, timeout: float) -> dict[str, Any]:
    """The pool of an engine opened for ``role`` when the setting says ``pool_size``.

    The ``backend`` role (``pulse://`` in a client: a web application's threads each
    waiting in ``AsyncResult.get()``) holds a connection per waiting thread for as long as
    it waits: its pool may overflow by :data:`BACKEND_OVERFLOW` and waits SQLAlchemy's
    default, as no lease depends on it. Inside a worker only one or two threads use it.
    """
    if role == "backend":
        return {"pool_size": pool_size, "max_overflow": BACKEND_OVERFLOW,
                "pool_timeout": BACKEND_POOL_TIMEOUT_S}
    if role == "gateway":
        pool_size = max(pool_size, GATEWAY_POOL_SIZE)
    return {"pool_size": CHILD_POOL_SIZE if role == "child" else pool_size,
            "max_overflow": 0, "pool_timeout": timeout}


def pool_timeout(renew_interval: float) -> float:
    """How long a thread waits for a pooled connection before the call fails."""
    return min(POOL_TIMEOUT_S, renew_interval / 2)


def connection_name(role: str) -> str:
    """``pulse:<role>:<pid>@<host>``, read when the connection opens (a forked child's
    connections carry its own pid)."""
    return f"pulse:{role}:{os.getpid()}@{socket.gethostname()}"[:NAME_LIMIT]


def name_connection(backend: str, driver: str, role: str, cparams: dict[str, Any]) -> None:
    """Add the connection's name to ``cparams`` (the driver's connect keywords), keeping
    any name the URL gives."""
    if backend == "postgresql":
        cparams.setdefault("fallback_application_name", connection_name(role))
    elif driver == "pymysql" and "program_name" not in cparams:
        cparams["program_name"] = connection_name(role)
