"""What the broker holds at the end of a fault scenario: for the checker (tasks a Redis
restart lost before any worker received them) and for a failed run's diagnosis."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import sqlalchemy as sa

from tests.fault.nemesis import Cluster
from tests.helpers import services
from tests.helpers.workers import Env

#: A worker's line saying it handed a task's new epoch back to the broker.
_REPUBLISHED = re.compile(r"re-dispatched as epoch|requeued as epoch")
#: A log line's leading timestamp, ``[2026-12-06 15:13:27,980: ...``: sortable as text.
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):")


def redis_messages(env: Env) -> tuple[list[str], dict[str, str]]:
    """The test queue's ready messages, and kombu's delivered-unacknowledged ones by tag."""
    import redis

    client: Any = redis.Redis.from_url(env.broker_url, socket_timeout=5)
    try:
        queued = [m.decode(errors="replace") for m in client.lrange(env.queue, 0, -1)]
        unacked = {tag.decode(): raw.decode(errors="replace")
                   for tag, raw in client.hgetall("unacked").items()}
    finally:
        client.close()
    return queued, unacked


def lost_by_redis(env: Env, cluster: Cluster, submitted: list[str],
                  claimed: set[str]) -> set[str]:
    """Tasks whose last publication Redis lost before any worker received it.

    kombu's Redis transport takes a message off the list (``BRPOP``) before it records
    it as unacknowledged; a restart that cuts the connection while the reply is on its
    way, or a SIGKILL of the consumer before it wrote the record, loses the message for
    good (docs/faq.md; the caller bounds how many its faults can lose). pulse's promises
    start when a worker receives a delivery: one that did leaves a claim, or the message
    stays unacknowledged (and is restored) until its claim is written, or the worker logs
    its id. Two kinds qualify, each nowhere in the queue and among no unacknowledged
    message:

    * a submitted task with no claim that no worker's log names;
    * a task Recover (or a requeue) published again, its claim ``open`` and published
      (no publish lease left), that no worker's log names after that publication: a
      re-publication is a message like the first, and the broker loses it the same way.
    """
    engine = sa.create_engine(env.store_url)
    try:
        with engine.connect() as conn:
            published = {r.task_id for r in conn.execute(sa.text(
                "select task_id from pulse_claims where state = 'open' and holder is null"))}
    finally:
        engine.dispose()
    missing = [t for t in submitted if t not in claimed]
    reopened = [t for t in submitted if t in published]
    if not missing and not reopened:
        return set()
    queued, unacked = redis_messages(env)
    held = queued + list(unacked.values())
    lines = [line for w in cluster.all for line in w.log().splitlines()]
    lost = {t for t in missing if not any(t in m for m in held)
            and not any(t in line for line in lines)}
    for task_id in reopened:
        if any(task_id in m for m in held):
            continue
        about = sorted(line for line in lines if task_id in line and _STAMP.match(line))
        last = max((i for i, line in enumerate(about) if _REPUBLISHED.search(line)),
                   default=None)
        if last is not None and last == len(about) - 1:
            lost.add(task_id)
    return lost


def broker_state(env: Env, cluster: Cluster, stuck: list[str]) -> list[str]:
    """Where the unsettled tasks' messages are: ready in the queue, or delivered and not
    acknowledged (since when, and whether kombu's sweep lock is left). Best effort."""
    out: list[str] = []
    try:
        if env.broker_url.startswith("redis"):
            import redis

            queued, unacked = redis_messages(env)
            client: Any = redis.Redis.from_url(env.broker_url, socket_timeout=5)
            since = {tag.decode(): score for tag, score in
                     client.zrange("unacked_index", 0, -1, withscores=True)}
            out.append(f"redis: {len(queued)} ready in {env.queue}, {len(unacked)} unacked, "
                       f"sweep lock ttl {client.ttl('unacked_mutex')} s")
            for task_id in stuck:
                ready = sum(task_id in m for m in queued)
                held = [f"{tag} (since {since.get(tag)})" for tag, raw in unacked.items()
                        if task_id in raw]
                out.append(f"  {task_id}: ready x{ready}, unacked {held}")
            client.close()
        else:
            ports = worker_ports(cluster)
            for args in (["list_queues", "name", "messages_ready", "messages_unacknowledged",
                          "consumers"],
                         ["list_channels", "connection", "name", "consumer_count",
                          "messages_unacknowledged", "prefetch_count"]):
                vhost = ["-p", services.vhost_of(env.broker_url)] if args[0] == "list_queues" else []
                proc = subprocess.run(["rabbitmqctl", "-q", *args, *vhost], capture_output=True,
                                      text=True, timeout=60, check=False)
                lines = proc.stdout.splitlines()
                if args[0] == "list_queues":
                    lines = [ln for ln in lines if env.queue in ln]
                else:  # our workers' channels, named by the connection's client port
                    lines = [f"{ln}  <- {name}" for ln in lines
                             for port, name in ports.items() if f":{port} ->" in ln]
                out.append(f"rabbitmqctl {args[0]}:")
                out += [f"  {ln}" for ln in lines]
    except Exception as exc:  # evidence is best effort
        out.append(f"broker unreadable: {exc!r}")
    return out


def worker_ports(cluster: Cluster) -> dict[int, str]:
    """Local TCP ports of the live workers' main processes, by ``ss``."""
    pids = {w.pid: name for name, w in cluster.workers.items() if w.proc.poll() is None}
    proc = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, timeout=30,
                          check=False)
    ports: dict[int, str] = {}
    for line in proc.stdout.splitlines():
        for pid, name in pids.items():
            if f"pid={pid}," in line:
                local = line.split()[3]
                ports[int(local.rsplit(":", 1)[1])] = name
    return ports
