"""libpq's socket calls for the hot path, made with the GIL released.

psycopg's compiled wrapper keeps the GIL across ``PQpipelineSync``, ``PQflush`` and
``PQconsumeInput``, each a ``send``/``recv`` system call. On a busy machine the kernel
often preempts the calling thread right there (the send wakes the PostgreSQL backend),
and for as long as it is off the CPU the worker's consumer loop cannot run a line of
Python: on 2 cores, a worker ran 4,000 no-op tasks at 1,194 tasks/s that way and at
1,263 with these three calls made through :mod:`ctypes`, which releases the GIL around
every foreign call (medians of three alternated runs). The library is the very libpq
psycopg loaded (the only one mapped into the process, and of the same version), and
the connection is psycopg's own ``PGconn``: nothing but the GIL changes. Where that
libpq can't be told for sure (not Linux, several mapped, psycopg's pure-Python build,
which releases the GIL itself) the psycopg calls are used as they are.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

import psycopg
from psycopg import pq


@functools.lru_cache(maxsize=1)
def gil_free_libpq() -> Any:
    """psycopg's libpq through :mod:`ctypes`, or None (see the module's docstring)."""
    if pq.__impl__ == "python" or not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {fields[5] for fields in (line.split(None, 5) for line in maps)
                     if len(fields) == 6 and os.path.basename(fields[5].strip())
                     .startswith("libpq")}
    except OSError:
        return None
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop().strip())
        if lib.PQlibVersion() != pq.version():
            return None
    except (OSError, AttributeError):
        return None
    for name in ("PQpipelineSync", "PQflush", "PQconsumeInput"):
        function = getattr(lib, name)
        function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int
    return lib


class SocketCalls:
    """``sync``, ``flush`` and ``consume`` of one psycopg connection's ``PGconn``."""

    def __init__(self, pgconn: Any) -> None:
        self.pgconn = pgconn
        self.lib = gil_free_libpq()
        self._ptr = ctypes.c_void_p(pgconn.pgconn_ptr) if self.lib is not None else None

    def _failed(self, what: str) -> psycopg.OperationalError:
        message = self.pgconn.error_message.decode("utf-8", "replace").strip()
        return psycopg.OperationalError(f"{what} failed: {message or 'connection lost'}")

    def sync(self) -> None:
        """Queue the pipeline's ``Sync`` and send what libpq holds."""
        if self.lib is None:
            self.pgconn.pipeline_sync()
        elif self.lib.PQpipelineSync(self._ptr) != 1:
            raise self._failed("sending the pipeline")

    def flush(self) -> bool:
        """Send what libpq holds; True if some of it is still unsent."""
        if self.lib is None:
            return bool(self.pgconn.flush())
        sent = self.lib.PQflush(self._ptr)
        if sent < 0:
            raise self._failed("sending to the server")
        return bool(sent)

    def consume(self) -> None:
        """Read what the server sent (never blocks: the connection is non-blocking)."""
        if self.lib is None:
            self.pgconn.consume_input()
        elif self.lib.PQconsumeInput(self._ptr) != 1:
            raise self._failed("reading from the server")
