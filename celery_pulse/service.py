"""One start/stop base for the worker's background threads.

Each background service (the lease keeper's commit, renew and watchdog threads,
Recover, the beat, the leader elector, the registry heartbeat) is one daemon thread
with a name, a loop (:meth:`Service.run`), a wake-up that cuts its sleep short, and a
stop that wakes it and joins it for a bounded time. What a service does between two
sleeps is its own module's; this module owns only the scaffolding, written once.

Rules:

* :meth:`Service.stop` sets the stop flag before it wakes the thread, so a loop that
  checks :attr:`Service.stopping` after :meth:`Service.sleep` returns sees it.
* A wake-up asked while the thread works is not lost: the next :meth:`Service.sleep`
  returns at once (it forgets the wake-up as it returns).
* Stopping never joins the calling thread (a service may be stopped from its own
  thread, e.g. by a listener it calls), and waits at most ``join_timeout`` seconds: the
  threads are daemons, a stuck one must not hold the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Service:
    """A background thread that runs :meth:`run` until stopped.

    Subclass it and define :meth:`run`, or (as with :class:`threading.Thread`) hand it
    the loop as ``target``: for a class whose own ``start`` means more than a thread.
    """

    def __init__(self, thread_name: str, *, join_timeout: float,
                 target: Callable[[], None] | None = None) -> None:
        self.thread_name = thread_name
        self.join_timeout = join_timeout
        self._target = target
        self._stopping = threading.Event()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """The thread's loop: return once :attr:`stopping`."""
        if self._target is None:
            raise NotImplementedError("a Service needs a run() or a target")
        self._target()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop, then wait (up to ``join_timeout``) for it to end."""
        self.signal_stop()
        self.join()

    def signal_stop(self) -> None:
        """Ask the thread to stop, without waiting for it."""
        self._stopping.set()
        self._wakeup.set()

    def join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.join_timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wake(self) -> None:
        """Cut the thread's current (or next) sleep short."""
        self._wakeup.set()

    def rearm(self) -> None:
        """Forget a wake-up asked before now (the work about to run serves it)."""
        self._wakeup.clear()

    def sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a wake-up or a stop; True if stopping (then at once)."""
        if self._stopping.is_set():
            return True
        self._wakeup.wait(seconds)
        if self._stopping.is_set():
            return True  # (the wake-up stays set: every later sleep returns at once)
        self._wakeup.clear()
        return False
