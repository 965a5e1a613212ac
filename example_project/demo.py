"""A one-minute story of what pulse does, on the embedded default (no servers).

    python -m example_project.demo

Starts real ``celery worker -P pulse`` processes in a temporary folder, submits
work, kills a worker, and narrates what the store says, then prints ``pulse status``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Demo:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = dict(os.environ, PULSE_EXAMPLE_DIR=str(folder / ".celery-pulse"),
                        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def celery(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "celery", "-A", "example_project", *args],
                              env=self.env, cwd=self.folder, capture_output=True, text=True,
                              timeout=60)

    def start_worker(self, name: str) -> None:
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project", "worker", "-P", "pulse",
             "-n", f"{name}@demo", "-c", "1", "-l", "info", "--without-mingle",
             "--without-gossip"], env=self.env, cwd=self.folder, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self) -> list[dict[str, Any]]:
        out = self.celery("pulse", "workers", "--json")
        return json.loads(out.stdout) if out.returncode == 0 else []

    def wait(self, what: str, predicate: Callable[[], bool], timeout: float) -> float:
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout:
                raise SystemExit(f"demo: gave up waiting for {what}")
            time.sleep(0.2)
        return time.monotonic() - start

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self) -> None:
        say("creating the schema: celery -A example_project pulse migrate")
        print(self.celery("pulse", "migrate").stdout.strip())
        for name in ("alpha", "bravo", "charlie"):
            self.start_worker(name)
        say("started three workers: alpha, bravo, charlie (-P pulse)")
        took = self.wait("three live registrations",
                         lambda: sum(w["alive"] for w in self.workers()) == 3, 60)
        say(f"all three registered with store-minted tokens after {took:.1f}s")
        say("SIGKILL alpha: no goodbye, its registration simply stops being renewed")
        os.killpg(self.procs["alpha"].pid, signal.SIGKILL)
        took = self.wait("alpha to expire",
                         lambda: any(w["id"].startswith("alpha@") and not w["alive"]
                                     for w in self.workers()), 60)
        say(f"the store clock declared alpha dead {took:.1f}s later (pulse_worker_ttl=5s)")
        say("SIGTERM bravo: a warm shutdown deregisters it")
        self.procs["bravo"].send_signal(signal.SIGTERM)
        self.procs["bravo"].wait(60)
        say(f"bravo exited with code {self.procs['bravo'].returncode}")
        say("final state: celery -A example_project pulse status")
        print(self.celery("pulse", "status").stdout)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="pulse-demo-") as tmp:
        demo = Demo(Path(tmp))
        demo.env["PULSE_DEMO_FAST"] = "1"
        try:
            demo.run()
        finally:
            demo.stop_all()


if __name__ == "__main__":
    main()
