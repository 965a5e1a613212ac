"""Leader failover of the periodic scheduler: pulse's leader-elected beat vs RedBeat.

Two scheduler replicas, a 1 s schedule, broker = the local Redis. The runner reads
every published tick straight off the queue (arrival time, task id). Replica 1 leads;
replica 2 is started and ready; then replica 1 gets SIGKILL (crash) or SIGTERM
(planned handover). Measured: signal -> first tick published after replica 1 is
gone, the longest gap between consecutive ticks, slots skipped, ticks sent twice.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import infra

PERIOD = 1.0
SCENARIOS: dict[str, dict[str, Any]] = {
    "pulse-defaults": {"kind": "pulse", "conf": {}, "label": "pulse, defaults (leader_ttl 15 s)"},
    "pulse-tuned": {"kind": "pulse", "conf": {"pulse_leader_ttl": 3, "pulse_leader_interval": 1},
                    "label": "pulse, leader_ttl 3 s, interval 1 s"},
    "redbeat-defaults": {"kind": "redbeat", "conf": {},
                         "label": "RedBeat, defaults (lock 1,500 s, retry 300 s)"},
    "redbeat-tuned": {"kind": "redbeat",
                      "conf": {"redbeat_lock_timeout": 3, "beat_max_loop_interval": 1},
                      "label": "RedBeat, lock_timeout 3 s, max_loop_interval 1 s"},
}


def expected(name: str, event: str) -> float:
    """What the configuration promises (s): crash -> ttl + interval + 1; handover -> interval."""
    conf = SCENARIOS[name]["conf"]
    if SCENARIOS[name]["kind"] == "pulse":
        ttl = float(conf.get("pulse_leader_ttl", 15))
        interval = float(conf.get("pulse_leader_interval", ttl / 3))
    else:
        interval = float(conf.get("beat_max_loop_interval", 300))
        ttl = float(conf.get("redbeat_lock_timeout", 5 * interval))
    return ttl + interval + 1.0 if event == "crash" else interval + 1.0


class Ticks:
    """Consumes the schedule's queue on a thread, recording (arrival, task id)."""

    def __init__(self, broker: str, queue: str) -> None:
        self.broker = broker
        self.queue = queue
        self.seen: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None
        self._ready = threading.Event()

    def start(self) -> Ticks:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the tick consumer did not start")
        return self

    def _run(self) -> None:
        from kombu import Connection

        def on_message(body: Any, message: Any) -> None:
            self.seen.append((time.time(), str((message.headers or {}).get("id"))))
            message.ack()

        try:
            with Connection(self.broker) as conn, conn.Consumer(
                    infra.kombu_queue(self.queue), callbacks=[on_message],
                    accept=["json"]):
                self._ready.set()
                while not self._stop.is_set():
                    with contextlib.suppress(socket.timeout, TimeoutError):
                        conn.drain_events(timeout=0.2)
        except Exception as exc:  # the broker dropped us: reported by stop()
            self._error = exc
            self._ready.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._error is not None:
            raise infra.Disturbed(f"the tick consumer lost the broker: {self._error!r}")

    def after(self, t: float) -> list[tuple[float, str]]:
        return [s for s in list(self.seen) if s[0] > t]


def _replica(scratch: infra.Scratch, name: str, kind: str, queue: str, store: str | None,
             conf: dict[str, Any], prefix: str) -> tuple[Any, str]:
    broker = infra.REDIS_URL
    extra = {"BENCH_BEAT_EVERY": str(PERIOD)}
    if kind == "pulse":
        argv = [sys.executable, "-m", "celery", "-A", "benchmarks.apps", "pulse", "beat",
                "--name", name]
    else:
        extra["BENCH_REDBEAT"] = infra.REDIS_URL
        conf = {**conf, "redbeat_key_prefix": prefix}
        argv = [sys.executable, "-m", "celery", "-A", "benchmarks.apps", "beat", "-l", "info",
                "--pidfile="]
    log_path = scratch.path(f"beat-{name}").with_suffix(".log")
    env = infra.app_env(broker, queue, store, conf, **extra)
    return infra.spawn(argv, env, log_path, scratch.dir), str(log_path)


def scenario(scratch: infra.Scratch, database_url: str, name: str, event: str,
             cap: float) -> dict[str, Any]:
    spec = SCENARIOS[name]
    queue = f"bench-beat-{uuid.uuid4().hex[:10]}"
    prefix = f"bench-redbeat-{uuid.uuid4().hex[:8]}:"
    infra.declare_queue(infra.REDIS_URL, queue)
    out: dict[str, Any] = {"scenario": name, "label": spec["label"], "event": event,
                           "expected_s": expected(name, event)}
    with contextlib.ExitStack() as stack:
        store = (stack.enter_context(infra.fresh_pg_schema(database_url))
                 if spec["kind"] == "pulse" else None)
        stack.callback(infra.delete_queue, infra.REDIS_URL, queue)
        ticks = Ticks(infra.REDIS_URL, queue).start()
        stack.callback(ticks.stop)
        procs: list[Any] = []

        def reap_all() -> None:
            for proc in procs:
                infra.reap(proc)
        stack.callback(reap_all)
        first, log1 = _replica(scratch, "beat-1", spec["kind"], queue, store, spec["conf"], prefix)
        procs.append(first)

        def ticking(after: float, count: int) -> bool:
            if first.poll() is not None:
                raise RuntimeError(f"beat replica 1 exited:\n{Path(log1).read_text()[-2000:]}")
            return len(ticks.after(after)) >= count
        infra.wait_for(lambda: ticking(0, 2), 40, "replica 1 to tick")
        second, log2 = _replica(scratch, "beat-2", spec["kind"], queue, store, spec["conf"],
                                prefix)
        procs.append(second)
        # Replica 2 is up (imports done, campaigning / blocked on the lock) after ~2 s.
        time.sleep(3.0)
        if second.poll() is not None:
            raise RuntimeError(f"beat replica 2 exited:\n{Path(log2).read_text()[-2000:]}")
        mark = time.time()
        infra.wait_for(lambda: ticking(mark, 2), 10, "ticks before the event")
        signalled = time.time()
        if event == "crash":
            infra.kill_group(first, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                first.send_signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            first.wait(15)
        gone = time.time()
        try:
            after = infra.wait_for(lambda: ticks.after(gone), cap, "a tick by replica 2", 0.01)
            takeover = after[0][0] - signalled
            time.sleep(3.0)  # catch-up slots and any duplicate land here
        except TimeoutError:
            takeover = None
        window = [t for t in ticks.seen if t[0] >= signalled - 3 * PERIOD]
        arrivals = [t[0] for t in window]
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        ids = [t[1] for t in window]
        # The same slot sent twice. pulse publishes one task id per slot, so the same id
        # again is exact (a missed slot caught up right before the next one is two ids
        # within milliseconds, not a duplicate). RedBeat's ids are random: two ticks
        # within 50 ms (two schedulers firing one slot) is the best sign there is.
        duplicates = len(ids) - len(set(ids))
        if spec["kind"] != "pulse":
            duplicates += sum(1 for g in gaps if g < 0.05)
        slots = round((arrivals[-1] - arrivals[0]) / PERIOD) + 1 if arrivals else 0
        done = takeover is not None and len(arrivals) > 1
        out.update({
            "takeover_s": takeover, "cap_s": cap,
            "max_gap_s": max(gaps) if done else None,
            "skipped_slots": max(0, slots - (len(arrivals) - duplicates)) if done else None,
            "duplicates": duplicates,
            "ticks": [round(t - signalled, 3) for t in arrivals],
        })
    return out


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    if quick:
        cases = [("pulse-tuned", "crash", 15.0), ("redbeat-tuned", "crash", 15.0)]
    else:
        cases = [("pulse-tuned", "crash", 15.0), ("redbeat-tuned", "crash", 15.0),
                 ("pulse-tuned", "handover", 15.0), ("redbeat-tuned", "handover", 15.0),
                 ("pulse-defaults", "crash", 30.0), ("pulse-defaults", "handover", 15.0),
                 ("redbeat-defaults", "crash", 15.0)]
    results = []
    for name, event, cap in cases:
        infra.log(f"failover: {name} {event}")
        result, _ = infra.retrying(
            functools.partial(scenario, scratch, database_url, name, event, cap),
            f"failover {name} {event}")
        infra.log(f"  takeover {result['takeover_s']}, max gap {result['max_gap_s']}, "
                  f"duplicates {result['duplicates']}")
        results.append(result)
    return {"cases": results, "period": PERIOD,
            "scenarios": {k: {"label": v["label"], "conf": v["conf"]} for k, v in SCENARIOS.items()}}
