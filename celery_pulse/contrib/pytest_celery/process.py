"""A local process in the role pytest-celery gives a Docker container.

pytest-celery's nodes talk to their "container" through a handful of members:
``name``, ``id``, ``status``, ``logs()``, ``kill(signal=...)``, ``restart()``,
``reload()``, ``ready()``, ``teardown()`` and ``celeryconfig``. This class offers
the same members over a subprocess in a process group of its own, so that the
nodes' own methods (``wait_for_log``, ``assert_log_exists`` ...) work unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal as signals
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

#: Signals a container runtime delivers to every process in it, not just its first one.
GROUP_SIGNALS = {signals.SIGKILL, signals.SIGSTOP, signals.SIGCONT}


def as_signal(value: str | int) -> int:
    """``"SIGTERM"``, ``"TERM"``, ``15`` -> ``signal.SIGTERM``."""
    if isinstance(value, int):
        return value
    name = value.upper()
    return int(getattr(signals, name if name.startswith("SIG") else f"SIG{name}"))


class LocalProcess:
    """A command run as a process group, its output kept in a log file.

    ``kill(SIGKILL)`` kills the whole group (as a killed container takes its
    children with it), ``kill(SIGSTOP)``/``kill(SIGCONT)`` pause and resume the whole
    group (``docker pause``); any other signal goes to the first process only (as
    ``docker kill --signal`` delivers it to PID 1).
    """

    def __init__(self, name: str, argv: Sequence[str], *, env: dict[str, str], cwd: Path,
                 ready_prompt: str | None = None, stop_timeout: float = 30.0) -> None:
        self.name = name
        self.id = uuid.uuid4().hex
        self.argv = list(argv)
        self.env = env
        self.cwd = cwd
        self.ready_prompt = ready_prompt
        self.stop_timeout = stop_timeout
        self.log_path = cwd / f"{name.replace('@', '_')}.log"
        self.celeryconfig: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._paused = False
        self._started_at = 0  # log offset of the current run

    # -- life ----------------------------------------------------------------------------
    def start(self) -> LocalProcess:
        if self.running:
            raise RuntimeError(f"{self.name} is already running")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by _reap()
        self._started_at = self.log_path.stat().st_size
        self._paused = False
        self._proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    @property
    def status(self) -> str:
        """Docker's words: ``created``, ``running``, ``paused`` or ``exited``."""
        if self._proc is None:
            return "created"
        if self._proc.poll() is not None:
            return "exited"
        return "paused" if self._paused else "running"

    def kill(self, signal: str | int = "SIGKILL") -> None:
        sig = as_signal(signal)
        if not self.running or self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if sig in GROUP_SIGNALS:
                if sig == signals.SIGKILL:
                    os.killpg(self._proc.pid, signals.SIGCONT)  # a paused group dies too
                os.killpg(self._proc.pid, sig)
            else:
                os.kill(self._proc.pid, sig)
        if sig == signals.SIGSTOP:
            self._paused = True
        elif sig == signals.SIGCONT:
            self._paused = False
        elif sig == signals.SIGKILL:
            self._reap(10.0)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM (a warm shutdown), then SIGKILL to the group after ``timeout``."""
        if self.running and self._proc is not None:
            self.kill("SIGCONT")
            self.kill("SIGTERM")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(self.stop_timeout if timeout is None else timeout)
        self._kill_group()

    def restart(self, timeout: float | None = None) -> None:
        """Stop (warm, then forced after ``timeout``) and start the same command again."""
        self.stop(timeout)
        self.start()

    def reload(self) -> None:
        """Nothing to refresh: the status is read from the process itself."""

    def teardown(self) -> None:
        """SIGKILL the whole group, whatever its state, and close the log."""
        self._kill_group()

    def _kill_group(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signals.SIGCONT)
                os.killpg(self._proc.pid, signals.SIGKILL)
        self._reap(10.0)

    def _reap(self, timeout: float) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- looking -------------------------------------------------------------------------
    def logs(self) -> str:
        """Everything the command printed, over all its runs."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def current_logs(self) -> str:
        """What the current (latest) run printed."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._started_at)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def ready(self, timeout: float = 60.0) -> bool:
        """Wait until the current run printed its ready prompt; raise if it exited first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.ready_prompt is None or self.ready_prompt in self.current_logs():
                return True
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.returncode}) before it was ready:\n"
                                   f"{self.current_logs()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:g}s:\n"
                                   f"{self.current_logs()[-3000:]}")
            time.sleep(0.05)

    def processes(self) -> list[dict[str, Any]]:
        """``pid``, ``name`` and ``cmdline`` of every live process of the group (Linux /proc)."""
        if not self.running or self._proc is None:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self._proc.pid:
                    continue
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                name = (entry / "comm").read_text().strip()
            except (OSError, ProcessLookupError):
                continue
            found.append({"pid": int(entry.name), "name": name,
                          "cmdline": [part.decode(errors="replace") for part in cmdline if part]})
        return sorted(found, key=lambda p: p["pid"])
