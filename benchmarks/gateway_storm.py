"""Section 10, admission: a legitimate worker's round trip during a bogus-token storm.

One gateway client holds a started attempt and renews it back to back (a round trip
each: the frame, the credential check, the store's renewal); its p50 and p99 are taken
idle, then while 200 handshakes at a time with well-formed, unknown tokens (each one a
credential lookup if it gets that far) hit the same gateway, again and again for the
same time. Issue 37's acceptance: the storm's p50 under 2x the idle p50.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import infra

STORM = 200


def _bogus() -> str:
    """A token of the right shape, for no credential: it reaches the store's lookup."""
    return f"pgw1_{secrets.token_hex(16)}_{secrets.token_urlsafe(32)[:43]}"


def _storm(url: str, context: ssl.SSLContext, stop: threading.Event) -> dict[str, int]:
    """Waves of ``STORM`` simultaneous bogus handshakes until ``stop``; their answers."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    answers: dict[str, int] = {}

    async def one() -> None:
        try:
            conn = await connect(url, ssl=context, compression=None, open_timeout=30,
                                 subprotocols=["pulse.worker.v1"],  # type: ignore[list-item]
                                 additional_headers={"Authorization": f"Bearer {_bogus()}"})
            await conn.close()
            key = "accepted"
        except InvalidStatus as exc:
            key = str(exc.response.status_code)
        except Exception as exc:  # counted by kind: the storm goes on
            key = type(exc).__name__
        answers[key] = answers.get(key, 0) + 1

    async def waves() -> None:
        while not stop.is_set():
            await asyncio.gather(*(one() for _ in range(STORM)))

    asyncio.run(waves())
    return answers


def _round_trips(renew: Callable[[], Any], seconds: float) -> list[float]:
    latencies = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        t0 = time.perf_counter()
        renew()
        latencies.append(time.perf_counter() - t0)
    return latencies


def run(store: str, url: str, ca: Path, seconds: float,
        credentials: Callable[[list[str]], str],
        percentiles: Callable[[list[float]], dict[str, float]]) -> dict[str, Any]:
    """Idle and storm round trips of one client (``credentials``: a token for queues)."""
    from celery_pulse.gateway.client import GatewayClient

    broker = infra.BROKERS["rabbitmq"]
    queue = f"bench-storm-{uuid.uuid4().hex[:10]}"
    token = credentials([queue])
    context = ssl.create_default_context(cafile=str(ca))
    infra.declare_queue(broker, queue)
    client = GatewayClient(url, token, queue_id=queue, capacity=1, ssl_context=context,
                           capabilities=[{"handler": "bench.noop", "handler_version": "1",
                                          "payload_version": "1"}])
    try:
        infra.publish(broker, queue, [("bench.noop", [])])
        client.start()
        assigned = client.assignments.get(timeout=30)
        client.start_task(assigned)
        idle = _round_trips(lambda: client.renew(assigned), seconds)
        stop = threading.Event()
        answers: dict[str, int] = {}
        storm = threading.Thread(target=lambda: answers.update(_storm(url, context, stop)))
        storm.start()
        try:
            time.sleep(1.0)  # the first wave under way
            stormy = _round_trips(lambda: client.renew(assigned), seconds)
        finally:
            stop.set()
            storm.join(120)
        client.finish(assigned, "SUCCEEDED", True)
    finally:
        client.close()
        infra.delete_queue(broker, queue)
    return {"idle": percentiles(idle), "storm": percentiles(stormy), "answers": answers,
            "handshakes_at_once": STORM}


def markdown(storm: dict[str, Any], lines: list[str]) -> None:
    """The report's lines for :func:`run`'s results."""
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(storm["answers"].items()))
    lines += ["", f"One worker's renewal round trip, back to back, idle and while "
              f"{storm['handshakes_at_once']} handshakes at a time with unknown tokens hit "
              f"the gateway (their answers: {answers}):", "",
              "| | renewals | p50 | p99 |", "| --- | --- | --- | --- |"]
    for key in ("idle", "storm"):
        r = storm[key]
        lines.append(f"| {key} | {r['count']} | {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms |")
    lines += ["", f"storm p50 / idle p50: "
              f"{storm['storm']['p50_ms'] / storm['idle']['p50_ms']:.2f}"]
