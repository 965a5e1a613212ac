"""The nemesis: seeded, bounded chaos against real worker processes and servers."""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.helpers.mariadb import PrivateServer
from tests.helpers.services import cut_vhost_connections
from tests.helpers.workers import Env, Worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A Redis of our own (append-only, fsync always: a restart loses no message)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pulse-redis-")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        binary = shutil.which("redis-server") or "redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError("private redis did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)

    def destroy(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """Three named workers that the nemesis may kill (and we restart) or pause."""

    def __init__(self, env: Env, start: Callable[..., Worker], names: list[str],
                 concurrency: int = 2, skews: dict[str, float] | None = None) -> None:
        self.env = env
        self.skews = dict(skews or {})
        self._start = start
        self.concurrency = concurrency
        self.workers: dict[str, Worker] = {}
        self.paused: set[str] = set()
        self.all: list[Worker] = []
        for name in names:
            self.spawn(name)

    def spawn(self, name: str) -> Worker:
        skew = self.skews.get(name, 0.0)
        worker = self._start(self.env, f"{name}@%h", concurrency=self.concurrency,
                             extra_env={"PULSE_FAULT_NODE": name, "PULSE_FAULT_SKEW": str(skew)})
        self.workers[name] = worker
        self.all.append(worker)
        return worker

    def kill(self, name: str) -> None:
        self.workers[name].kill()
        self.paused.discard(name)

    def pause(self, name: str) -> None:
        self.workers[name].signal(signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        self.workers[name].signal(signal.SIGCONT)
        self.paused.discard(name)

    def heal(self) -> None:
        for name, worker in list(self.workers.items()):
            if name in self.paused:
                self.resume(name)
            if worker.proc.poll() is not None:
                self.spawn(name)

    def logs(self) -> str:
        return "\n".join(w.log() for w in self.all)


class Nemesis(threading.Thread):
    """Every 2 to 4 s one fault, chosen by a seeded RNG; faults heal before the next.

    With ``holders`` (the names of the workers running a limited task now), half of the
    SIGKILLs and SIGSTOPs aim at one of them when there is one: a permit must come back
    with Recover's takeover and a stale holder must free nothing, which only a fault
    that hits a holder exercises. The RNG draws the same numbers either way, so a seed
    replays the same sequence of actions.
    """

    #: The share of kills and pauses aimed at a permit holder (when there is one).
    AIM = 0.5

    def __init__(self, seed: int, cluster: Cluster, store: PrivateServer,
                 broker_fault: Callable[[], None], duration: float,
                 holders: Callable[[], list[str]] | None = None) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.rng = random.Random(seed)
        self.cluster = cluster
        self.store = store
        self.broker_fault = broker_fault
        self.duration = duration
        self.holders = holders
        self.log: list[str] = []
        #: Kills and pauses that hit a worker running a limited task.
        self.aimed = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def note(self, text: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {text}")

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _run(self) -> None:
        end = time.monotonic() + self.duration
        names = sorted(self.cluster.workers)
        # One of the first three faults stops the store: every run has a store outage.
        store_at = self.rng.randrange(3)
        for step in itertools.count():
            if time.monotonic() >= end or self._stop_event.is_set():
                break
            self._stop_event.wait(self.rng.uniform(2.0, 4.0))
            action = self.rng.choice(["kill", "kill", "pause", "broker", "store"])
            if step == store_at:
                action = "store"
            name = self.rng.choice(names)
            aim = self.rng.random()
            why = ""
            if action in ("kill", "pause") and aim < self.AIM:
                holding = self._holding(names)
                if holding:
                    name = holding[int(aim / self.AIM * len(holding))]
                    why = " (running faultapp.limited: holds a permit)"
                    self.aimed += 1
                else:
                    why = " (aimed at a permit holder: none running)"
            if action == "kill":
                self.note(f"SIGKILL {name}{why}")
                self.cluster.kill(name)
                self._stop_event.wait(1.0)
                self.cluster.spawn(name)
            elif action == "pause":
                self.note(f"SIGSTOP {name} for 5s{why}")
                self.cluster.pause(name)
                self._stop_event.wait(5.0)
                self.cluster.resume(name)
            elif action == "broker":
                self.note("broker fault")
                self.broker_fault()
            else:
                self.note("store down for 4s")
                self.store.stop()
                self._stop_event.wait(4.0)
                self.store.start()

    def _holding(self, names: list[str], patience: float = 2.0) -> list[str]:
        """The workers running a limited task now, waiting up to ``patience`` seconds for
        one (none if the question fails: then the fault hits the worker drawn at
        random)."""
        if self.holders is None:
            return []
        give_up = time.monotonic() + patience
        while not self._stop_event.is_set():
            try:
                found = set(self.holders())
            except Exception as exc:  # the history is only a hint here
                self.note(f"permit holders unknown: {exc!r}")
                return []
            holding = [n for n in names if n in found and n not in self.cluster.paused]
            if holding or time.monotonic() >= give_up:
                return holding
            self._stop_event.wait(0.2)
        return []

    def stop(self) -> None:
        self._stop_event.set()


def rabbit_fault(broker_url: str) -> Callable[[], None]:
    """Drop every client connection on the scenario's own vhost, as a broker restart would
    (the tests running beside it keep theirs)."""
    def fault() -> None:
        cut_vhost_connections(broker_url, "pulse nemesis")
    return fault


def redis_fault(redis: PrivateRedis) -> Callable[[], None]:
    def fault() -> None:
        redis.stop()
        time.sleep(1.0)
        redis.start()
    return fault


__all__ = ["Any", "Cluster", "Nemesis", "PrivateRedis", "rabbit_fault", "redis_fault"]
