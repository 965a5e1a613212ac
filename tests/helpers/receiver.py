"""A real ``celery.events.EventReceiver`` in a process of its own, as Flower runs one.

``python -m tests.helpers.receiver BROKER_URL OUT`` captures every event on the broker's
event exchange and appends each, as one JSON line, to ``OUT``; it touches ``OUT.ready``
once its queue consumes (events sent before that are not seen). :class:`EventLog` starts
it, reads what it received and kills it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery
from celery.events.receiver import EventReceiver
from celery.events.state import State

from celery_pulse.testing import wait_for

ROOT = Path(__file__).resolve().parents[2]

Event = dict[str, Any]


class _Receiver(EventReceiver):  # type: ignore[misc]
    def __init__(self, *args: Any, ready: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ready_path = ready

    def on_consume_ready(self, connection: Any, channel: Any, consumers: Any,
                         **kwargs: Any) -> None:
        super().on_consume_ready(connection, channel, consumers, **kwargs)
        self.ready_path.touch()


def main(broker_url: str, out: str) -> None:
    app = Celery("pulse-event-receiver", broker=broker_url)
    path = Path(out)

    def record(event: Event) -> None:
        line = json.dumps(event, default=repr) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    with app.connection_for_read() as connection:
        receiver = _Receiver(connection, app=app, handlers={"*": record},
                             ready=Path(f"{out}.ready"))
        receiver.capture(limit=None, timeout=None, wakeup=False)


class EventLog:
    """The receiver process of one test and the events it received, in arrival order."""

    def __init__(self, broker_url: str, folder: Path) -> None:
        self.path = folder / f"events-{os.getpid()}-{id(self)}.jsonl"
        self._log = open(folder / "receiver.log", "a")  # noqa: SIM115 - closed in kill()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                            os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.receiver", broker_url, str(self.path)],
            env=env, cwd=folder, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        ready = Path(f"{self.path}.ready")
        wait_for(lambda: ready.exists() or self._died(), 30, "the event receiver to consume")

    def _died(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the event receiver exited ({self.proc.returncode}):\n"
                                 f"{Path(self._log.name).read_text()[-3000:]}")
        return False

    def events(self) -> list[Event]:
        """Every event received so far (a line being written is left out)."""
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.splitlines()
        if text and not text.endswith("\n"):
            lines = lines[:-1]
        return [json.loads(line) for line in lines]

    def of(self, type_: str, **match: Any) -> list[Event]:
        """The events of ``type_`` whose fields equal ``match``."""
        return [e for e in self.events() if e.get("type") == type_
                and all(e.get(k) == v for k, v in match.items())]

    def wait(self, type_: str, timeout: float, *, what: str = "",
             alive: Callable[[], None] = lambda: None, **match: Any) -> Event:
        """The first event of ``type_`` matching ``match``, once it has arrived."""
        def found() -> Event | None:
            alive()
            self._died()
            got = self.of(type_, **match)
            return got[0] if got else None
        try:
            event: Event = wait_for(found, timeout, what or f"a {type_} event {match}")
        except AssertionError as exc:  # what did arrive says why
            seen = [(e.get("type"), e.get("hostname"), e.get("uuid")) for e in self.events()
                    if not str(e.get("type")).startswith("worker-")]
            raise AssertionError(f"{exc}; received meanwhile: {seen}") from None
        return event

    def state(self) -> State:
        """A real ``celery.events.state.State`` (Flower's) fed every event received."""
        state = State()
        for event in self.events():
            state.event(dict(event))
        return state

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
