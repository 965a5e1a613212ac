"""The Pulse pages through a real ``celery pulse flower``, on a store of 100,000 claims.

    python -m benchmarks.pulse_pages [--stores postgres,mariadb,sqlite] [--claims N]

Fills a fresh store of each kind as ``benchmarks/monitor_queries.py`` does (its own
database, ``pulse_bench_pages``), starts ``celery -A benchmarks.pulse_pages pulse flower``
on it, and times each page and API answer over HTTP, end to end (Tornado, the handler,
the store on Flower's executor, the template): one warm-up, then the median of five.
The target is < 300 ms per page.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from celery import Celery

import celery_pulse

#: The app the Flower process loads (``-A benchmarks.pulse_pages``): the store from the env.
app = Celery("pulse-pages", broker=os.environ.get("PULSE_PAGES_BROKER", "memory://"))
app.conf.pulse_store_url = os.environ.get("PULSE_PAGES_STORE")
celery_pulse.install(app)

ROOT = Path(__file__).resolve().parents[1]
REPEAT = 5


def pages(holder: str, task_id: str) -> list[str]:
    return ["/pulse/claims", "/api/pulse/claims", "/api/pulse/claims?state=needs_review",
            "/api/pulse/claims?state=running", "/api/pulse/claims?queue=rare",
            "/api/pulse/claims?task=proj.tasks.t39", f"/api/pulse/claims?worker={holder}",
            "/api/pulse/claims?state=failed&queue=billing", f"/pulse/claim/{task_id}",
            "/pulse/review", "/api/pulse/review", "/api/pulse/review?queue=billing",
            "/pulse/workers", "/pulse/leader", "/pulse/permits", "/api/pulse/permits"]


def get_ms(url: str) -> float:
    begun = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as resp:
        resp.read()
        assert resp.status == 200, (url, resp.status)
    return (time.perf_counter() - begun) * 1000


def run(kind: str, n: int) -> dict[str, float]:
    from benchmarks import monitor_queries as mq
    from celery_pulse.store.pages import ClaimQuery
    from celery_pulse.store.sql.factory import open_store

    mq.DATABASE = "pulse_bench_pages"
    url, drop = mq.create_database(kind)
    store = open_store(url, check_schema=False)
    flower = None
    try:
        store.migrate()
        mq.fill(store, n)
        holder = store.find_claims(ClaimQuery(states=("running",), limit=1)).rows[0].holder
        task_id = store.list_review(limit=1)[0].task_id
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        env = {**os.environ, "PULSE_PAGES_STORE": url, "FLOWER_UNAUTHENTICATED_API": "true",
               "PYTHONPATH": str(ROOT)}
        flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", "benchmarks.pulse_pages",
                                   "pulse", "flower", f"--port={port}", "--address=127.0.0.1"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                get_ms(base + "/healthcheck")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        out = {}
        for path in pages(holder or "", task_id):
            get_ms(base + path)
            out[path] = statistics.median(get_ms(base + path) for _ in range(REPEAT))
        return out
    finally:
        if flower is not None:
            flower.kill()
            flower.wait(10)
        store.close()
        drop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default="postgres,mariadb,sqlite")
    parser.add_argument("--claims", type=int, default=100_000)
    args = parser.parse_args(argv)
    kinds = args.stores.split(",")
    results = {kind: run(kind, args.claims) for kind in kinds}
    paths = list(next(iter(results.values())))
    width = max(len(p) for p in paths)
    print(f"\n{'page (median ms of 5, over HTTP)':<{width}}  " + "  ".join(f"{k:>9}" for k in kinds))
    for path in paths:
        print(f"{path:<{width}}  " + "  ".join(f"{results[k][path]:9.1f}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
