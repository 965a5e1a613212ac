"""Where a ``-P pulse`` worker's time goes under load: py-spy on the parent and its children.

One pulse worker (RabbitMQ, PostgreSQL store unless ``PULSE_BENCH_PROFILE_STORE`` names
another kind of :func:`~benchmarks.infra.fresh_store`, ``-c 2``) works through a long queue of
no-op tasks while ``py-spy record --subprocesses --idle`` samples every thread for a
few seconds. Each sample of the consumer loop (the parent's main thread) is put in
one category by the frames on its stack; pool children are split into "waiting for
a job" and the rest; the commit thread (on PostgreSQL it only takes what would block
the loop, which runs the exchanges itself) into the exchange's round trip, its Python
side and idle.
Sampling slows the worker down, so only shares are reported, not a rate.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import infra

#: (substring of a frame, category) for the consumer loop; first match wins.
LOOP_CATEGORIES = (
    ("ConsumeGate.apply", "prefetch gate: basic.cancel / basic.consume (blocking RPC)"),
    ("_epoll.poll", "idle (waiting in epoll)"),
    ("LoopCommitter._on_io", "store exchange: answers read and handed out"),
    ("LoopCommitter", "store exchange: statements sent"),
    ("PulseWorker.ack", "ack after the reservation"),
    ("Intake._settle", "reservation settled: Celery strategy, request"),
    ("Intake.wrap", "intake: delivery handler"),
    ("TaskPool.apply_async", "pool apply_async"),
    ("on_result", "task result handling"),
    ("asynpool", "billiard pool I/O"),
    ("billiard", "billiard pool I/O"),
    ("amqp", "AMQP frames: receive and parse"),
)


def py_spy() -> str | None:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    return found


def categorise(raw: Path) -> dict[str, Any]:
    loop: collections.Counter[str] = collections.Counter()
    children: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    commit: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        if len(frames) < 2:
            continue
        if frames[1].startswith("process "):  # a pool child (nested under the parent)
            child = frames[1].split(":", 1)[0]
            if "Connection._recv" in frames[-1] or "Connection._poll" in frames[-1]:
                children[child]["waiting for a job"] += n
            elif any("SqlStore.start" in f for f in frames):
                children[child]["claim start (in the child: synchronous loop only)"] += n
            elif any("bench.noop" in f or "apps.py" in f for f in frames):
                children[child]["task body"] += n
            else:
                children[child]["Celery tracer, result send, other"] += n
        elif frames[1].startswith("_run_module_as_main"):
            for key, name in LOOP_CATEGORIES:
                if any(key in f for f in frames):
                    loop[name] += n
                    break
            else:
                loop["other"] += n
        elif any("CommitThread.run" in f or "_commit_loop" in f for f in frames):
            if any("Pipeline.run" in f for f in frames):
                commit["exchange: pipelined round trip (psycopg)"] += n
            elif any("exchange" in f for f in frames):
                commit["exchange: statements and answers (Python)"] += n
            elif "wait" in frames[-1].lower():
                commit["idle"] += n
            else:
                commit["other"] += n

    def shares(counter: collections.Counter[str]) -> dict[str, float]:
        total = sum(counter.values())
        return {k: 100.0 * v / total for k, v in counter.most_common()} if total else {}

    merged: collections.Counter[str] = collections.Counter()
    for counter in children.values():
        merged.update(counter)
    return {"consumer_loop": shares(loop), "children": shares(merged),
            "commit_thread": shares(commit),
            "children_count": len(children)}


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    result, _ = infra.retrying(lambda: measure(scratch, quick), "profile")
    return result  # type: ignore[no-any-return]


def measure(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    spy = py_spy()
    if spy is None:
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    database_url = infra.ensure_bench_database()
    broker = infra.RABBIT_URL
    queue = f"bench-prof-{uuid.uuid4().hex[:10]}"
    seconds = 4 if quick else 6
    raw = scratch.path("profile").with_suffix(".txt")
    kind = os.environ.get("PULSE_BENCH_PROFILE_STORE", "postgres")
    with infra.fresh_store(kind, scratch, database_url) as store:
        infra.declare_queue(broker, queue)
        try:
            infra.publish(broker, queue, [("bench.noop", [])] * (3000 if quick else 8000))
            with infra.workers() as started:
                worker = infra.Worker(scratch, "prof", pool="pulse", concurrency=2,
                                      broker=broker, queue=queue, store=store)
                started.append(worker)
                worker.wait_ready()
                time.sleep(0.5)
                infra.log(f"profile: py-spy on a pulse worker for {seconds}s")
                proc = subprocess.run(
                    [spy, "record", "-p", str(worker.pid), "--subprocesses", "--idle",
                     "-r", "200", "-d", str(seconds), "-f", "raw", "-o", str(raw)],
                    capture_output=True, text=True, timeout=seconds + 60)
                worker.check_alive()
                worker.check_undisturbed()
                if proc.returncode != 0 or not raw.exists():
                    return {"skipped": f"py-spy failed: {proc.stderr.strip()[-500:]}"}
        finally:
            infra.delete_queue(broker, queue)
    result = categorise(raw)
    result.update({"seconds": seconds, "rate_hz": 200, "store": kind})
    return result
