"""Section 10: through the lease gateway (issue 18) vs directly connected.

Throughput: the same tasks, published before the worker starts, run by one ``-P pulse``
worker with ``-c 2`` connected to the store and the broker (``direct``), by one that
holds only a gateway credential (``gateway``: every delivery reserved by a
``celery pulse gateway`` process on the same machine, over TLS, and its starts, renewals
and finishes sent to it, each exchange's all at once), by two such workers on the
one gateway (``two remote workers``: two / one is the gateway's scaling), by two
such workers each on a gateway of its own, both on the one store (``two gateways``:
gateway processes share nothing but the store, so a fleet adds them), and by one remote
worker with ``worker_prefetch_multiplier = 16`` (a deeper prefetch, so bigger dispatch
rounds and group commits; the others keep Celery's 4). Runs
alternate; the ratio is the median of per-repeat ratios. Results are ignored on every
side (the throughput of results is section 1's).

Renewal latency: 50 gateway clients connected at once (``GatewayClient``, in threads of
the runner), each holding one started attempt and renewing it once a second; against 50
threads each renewing one lease of its own directly in the store. Latency is the
round trip of one renewal (request to answer), p50 and p99 over every renewal.
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks import gateway_cycle, gateway_storm, infra

CONCURRENCY = 2
X = "\N{MULTIPLICATION SIGN}"
CLIENTS = 50
RENEW_EVERY = 1.0
VARIANTS = ("direct", "gateway", "gateway2", "gateways2", "gateway32")
#: The prefetch multiplier of the ``gateway32`` variant (the others keep Celery's 4).
DEEP_MULTIPLIER = 16
#: The tasks the renewal clients run (capabilities route tasks: docs/gateway.md).
CAPABILITIES = [{"handler": "bench.noop", "handler_version": "1", "payload_version": "1"}]


@contextlib.contextmanager
def _tls(scratch: infra.Scratch) -> Iterator[tuple[Path, Path, Path]]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    folder = scratch.path("tls")
    folder.mkdir()
    cert.private_key_pem.write_to_path(folder / "key.pem")
    with open(folder / "cert.pem", "wb") as fh:
        for pem in cert.cert_chain_pems:
            fh.write(pem.bytes())
    ca.cert_pem.write_to_path(folder / "ca.pem")
    yield folder / "cert.pem", folder / "key.pem", folder / "ca.pem"


@contextlib.contextmanager
def _gateway(scratch: infra.Scratch, store: str, tls: tuple[Path, Path, Path]
             ) -> Iterator[tuple[str, int]]:
    """A ``celery pulse gateway`` process on the benchmark app: its wss:// URL and pid."""
    environ = infra.app_env(infra.BROKERS["rabbitmq"], "unused", store)
    log_path = scratch.path("gateway").with_suffix(".log")
    proc = infra.spawn([sys.executable, "-m", "celery", "-A", "benchmarks.apps", "pulse",
                        "gateway", "--bind", "127.0.0.1:0", "--certfile", str(tls[0]),
                        "--keyfile", str(tls[1])], environ, log_path, scratch.dir)
    try:
        def serving() -> str | None:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{log_path.read_text()[-3000:]}")
            found = re.search(r"on wss://127\.0\.0\.1:(\d+)/", log_path.read_text())
            return found.group(1) if found else None
        port = infra.wait_for(serving, 60, "the gateway to listen", 0.05)
        yield f"wss://localhost:{port}/v1/worker/connect", proc.pid
    finally:
        infra.reap(proc)


def _credentials(store: str, queues: list[str], scratch: infra.Scratch) -> tuple[str, Path]:
    from celery_pulse.gateway.credentials import CONNECT, CONSUME
    from celery_pulse.store.sql import open_store

    opened = open_store(store)
    try:
        _, token = opened.credentials.create_credential(
            f"bench-{uuid.uuid4().hex[:8]}", [CONNECT, CONSUME], queues, "benchmarks")
    finally:
        opened.close()
    path = scratch.path("credentials").with_suffix(".json")
    path.write_text(json.dumps({"token": token}))
    return token, path


def _cpu(pids: list[int]) -> float:
    return sum(infra.cpu_seconds(pids).values())


def _throughput(scratch: infra.Scratch, store: str, gateways: list[tuple[str, int]],
                ca: Path, variant: str, task: str, args: list[Any], n: int
                ) -> dict[str, float]:
    """Tasks a second of ``variant``: ``direct``, ``gateway`` (one remote worker),
    ``gateway2`` (two remote workers on the first gateway, each ``-c 2``) or
    ``gateways2`` (two remote workers, one on each gateway) or ``gateway32`` (one remote
    worker, prefetch multiplier 16); and the CPU milliseconds
    per task of the workers (every process of theirs) and of the gateways used, between
    the workers' ready and the last task."""
    broker = infra.BROKERS["rabbitmq"]
    queue = f"bench-gw-{uuid.uuid4().hex[:10]}"
    stop_file = scratch.path("stop")
    conf: dict[str, Any] = {"task_ignore_result": True}
    if variant == "gateway32":
        conf["worker_prefetch_multiplier"] = DEEP_MULTIPLIER
    remote = variant.startswith("gateway")
    if remote:
        _, credentials = _credentials(store, [queue], scratch)
        conf.update(pulse_gateway_credentials=str(credentials), pulse_gateway_ca=str(ca))
    infra.declare_queue(broker, queue)
    try:
        infra.publish(broker, queue, [(task, args)] * n + [("bench.stop", [str(stop_file)])])
        with infra.workers() as started:
            used = gateways if variant == "gateways2" else gateways[:1]
            for i in range(1 if variant in ("direct", "gateway", "gateway32") else 2):
                url = used[i % len(used)][0]
                started.append(infra.Worker(scratch, f"gw-{variant}-{i}", pool="pulse",
                                            concurrency=CONCURRENCY, broker=broker,
                                            queue=queue, store=None if remote else store,
                                            conf={**conf, "pulse_gateway_url": url}
                                            if remote else conf))
            ready = max(worker.wait_ready(timeout=60) for worker in started)
            gateway_pids = [pid for _, pid in used] if remote else []
            worker_pids = [pid for worker in started for pid in worker.pids()]
            cpu = (_cpu(worker_pids), _cpu(gateway_pids))

            def stopped() -> bool:
                for worker in started:
                    worker.check_alive()
                return stop_file.exists() and stop_file.stat().st_size > 0
            infra.wait_for(stopped, max(120.0, n / 5), f"{n} x {task} on {variant}", 0.02)
            stop = float(stop_file.read_text().split()[-1])
            spent = (_cpu(worker_pids) - cpu[0], _cpu(gateway_pids) - cpu[1])
    finally:
        infra.delete_queue(broker, queue)
    return {"rate": n / (stop - ready), "worker_cpu_ms": 1000 * spent[0] / n,
            "gateway_cpu_ms": 1000 * spent[1] / n,
            "cycle": gateway_cycle.measure(store, queue)}


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "count": len(ordered)}


def _renew_threads(count: int, seconds: float, renew: Callable[[int], None]
                   ) -> list[float]:
    """``count`` threads, each calling ``renew(i)`` every RENEW_EVERY for ``seconds``."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        next_at = time.monotonic() + RENEW_EVERY * i / count  # spread over the interval
        while next_at < stop:
            time.sleep(max(0.0, next_at - time.monotonic()))
            t0 = time.perf_counter()
            renew(i)
            elapsed = time.perf_counter() - t0
            with lock:
                latencies.append(elapsed)
            next_at += RENEW_EVERY
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def _renew_via_gateway(scratch: infra.Scratch, store: str, url: str, ca: Path,
                       seconds: float) -> dict[str, float]:
    import ssl

    from celery_pulse.gateway.client import GatewayClient

    broker = infra.BROKERS["rabbitmq"]
    queue = f"bench-gw-{uuid.uuid4().hex[:10]}"
    token, _ = _credentials(store, [queue], scratch)
    context = ssl.create_default_context(cafile=str(ca))
    infra.declare_queue(broker, queue)
    clients: list[GatewayClient] = []
    try:
        infra.publish(broker, queue, [("bench.noop", [])] * CLIENTS)
        held = []
        for _ in range(CLIENTS):
            client = GatewayClient(url, token, queue_id=queue, capabilities=CAPABILITIES,
                                   capacity=1, ssl_context=context)
            clients.append(client)
            client.start()
            assigned = client.assignments.get(timeout=30)
            client.start_task(assigned)
            held.append(assigned)
        latencies = _renew_threads(CLIENTS, seconds,
                                   lambda i: clients[i].renew(held[i]) and None)
        for client, assigned in zip(clients, held, strict=True):
            client.finish(assigned, "SUCCEEDED", True)
    finally:
        for client in clients:
            client.close()
        infra.delete_queue(broker, queue)
    return _percentiles(latencies)


def _renew_direct(store: str, seconds: float) -> dict[str, float]:
    from celery_pulse.store.base import Grant, Message, ReserveRequest
    from celery_pulse.store.sql import open_store

    opened = open_store(store)
    try:
        leases = []
        for i in range(CLIENTS):
            task_id = uuid.uuid4().hex
            message = Message(b"[]", {"id": task_id, "task": "bench.noop"}, {}, {}, "", "")
            [grant] = opened.reserve(f"direct-{i}", [ReserveRequest(
                task_id, "bench.noop", message, "review", 3)], 30.0)
            assert isinstance(grant, Grant)
            opened.start(f"direct-{i}", grant.task_id, grant.epoch, grant.token, 30.0)
            leases.append((grant.task_id, grant.epoch, grant.token))
        latencies = _renew_threads(CLIENTS, seconds, lambda i: opened.renew(
            f"direct-{i}", [leases[i]], 30.0) and None)
    finally:
        opened.close()
    return _percentiles(latencies)


def _by_repeat(runs: list[dict[str, Any]], variant: str) -> dict[int, float]:
    return {r["repeat"]: r["rate"] for r in runs if r["variant"] == variant}


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    workloads = ([("noop-300", "300 no-op", "bench.noop", [], 300),
                  ("sleep-200", f"200 {X} 10 ms", "bench.sleep", [10], 200)] if quick else
                 [("noop-1000", "1,000 no-op", "bench.noop", [], 1000),
                  ("sleep-500", f"500 {X} 10 ms", "bench.sleep", [10], 500)])
    repeats = 1 if quick else 2
    seconds = 5.0 if quick else 15.0
    runs: list[dict[str, Any]] = []
    with infra.fresh_pg_schema(database_url) as store, _tls(scratch) as tls, \
            _gateway(scratch, store, tls) as first, _gateway(scratch, store, tls) as second:
        url = first[0]
        for key, label, task, args, n in workloads:
            for rep in range(repeats):
                for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                    infra.log(f"gateway {key} {variant} (#{rep + 1}/{repeats})")
                    measured = _throughput(scratch, store, [first, second], tls[2], variant,
                                           task, args, n)
                    infra.log(f"  {measured['rate']:.0f} tasks/s; CPU per task: workers "
                              f"{measured['worker_cpu_ms']:.2f} ms, gateways "
                              f"{measured['gateway_cpu_ms']:.2f} ms; a slot held "
                              f"{measured['cycle'].get('held_ms', 0):.1f} ms")
                    runs.append({"workload": key, "label": label, "variant": variant,
                                 "repeat": rep, **measured})
        infra.log("gateway renew latency: 50 connected clients")
        through = _renew_via_gateway(scratch, store, url, tls[2], seconds)
        direct = _renew_direct(store, seconds)
        infra.log(f"gateway admission: {gateway_storm.STORM} bogus-token handshakes at once")
        storm = gateway_storm.run(store, url, tls[2], seconds,
                                  lambda queues: _credentials(store, queues, scratch)[0],
                                  _percentiles)
    summary = []
    for key, label, *_ in workloads:
        mine = [r for r in runs if r["workload"] == key]
        ratios = [g["rate"] / d["rate"] for g, d in zip(
            sorted((r for r in mine if r["variant"] == "gateway"), key=lambda r: r["repeat"]),
            sorted((r for r in mine if r["variant"] == "direct"), key=lambda r: r["repeat"]),
            strict=True)]
        summary.append({"workload": key, "label": label,
                        "direct": statistics.median(r["rate"] for r in mine
                                                    if r["variant"] == "direct"),
                        "gateway": statistics.median(r["rate"] for r in mine
                                                     if r["variant"] == "gateway"),
                        "ratio": statistics.median(ratios),
                        "two": statistics.median(r["rate"] for r in mine
                                                 if r["variant"] == "gateway2"),
                        "two_ratio": statistics.median(
                            _by_repeat(mine, "gateway2")[rep] / one
                            for rep, one in _by_repeat(mine, "gateway").items()),
                        "two_gateways": statistics.median(
                            r["rate"] for r in mine if r["variant"] == "gateways2"),
                        "two_gateways_ratio": statistics.median(
                            _by_repeat(mine, "gateways2")[rep] / one
                            for rep, one in _by_repeat(mine, "gateway").items()),
                        "cpu_ms": {variant: {side: statistics.median(
                            r[f"{side}_cpu_ms"] for r in mine if r["variant"] == variant)
                            for side in ("worker", "gateway")}
                            for variant in VARIANTS},
                        "cycle": {variant: {part: statistics.median(
                            r["cycle"][part] for r in mine if r["variant"] == variant)
                            for part in ("reserve_start_ms", "start_finish_ms", "held_ms")}
                            for variant in ("direct", "gateway")},
                        "deep": statistics.median(r["rate"] for r in mine
                                                  if r["variant"] == "gateway32"),
                        "deep_ratio": statistics.median(
                            _by_repeat(mine, "gateway32")[rep] / d
                            for rep, d in _by_repeat(mine, "direct").items())})
    return {"runs": runs, "summary": summary, "concurrency": CONCURRENCY,
            "renew": {"clients": CLIENTS, "every_s": RENEW_EVERY, "seconds": seconds,
                      "gateway": through, "direct": direct},
            "storm": storm}
