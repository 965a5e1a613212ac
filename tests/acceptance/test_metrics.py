"""Prometheus with real ``celery worker -P pulse`` processes (issue 34, item 4).

Every test scrapes a worker's real HTTP port with urllib and parses the answer with
``prometheus_client.parser.text_string_to_metric_families``, as Prometheus would. The
cluster families (``pulse_cluster_*``, ``pulse_store_up``) are read from the store by
the leader only; the tests check that the other worker exports none of them.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from tests.helpers.workers import Env, Worker, wait_alive, wait_for

prometheus_parser = pytest.importorskip("prometheus_client.parser")

FAST: dict[str, Any] = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5,
                        "pulse_lease_ttl": 3, "pulse_renew_interval": 0.5,
                        "pulse_recover_interval": 0.5, "pulse_revoke_grace": 2,
                        "pulse_leader_ttl": 3, "pulse_leader_interval": 1,
                        "pulse_metrics_interval": 0.5}
GATED = "permitapp.gated"
CLUSTER = ("pulse_store_up", "pulse_cluster_")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def scrape(url: str, timeout: float = 5) -> Samples | None:
    """Every sample of ``url`` as ``{(name, sorted labels): value}``; None if no answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: Samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def cluster_names(samples: Samples) -> set[str]:
    return {name for name, _labels in samples if name.startswith(CLUSTER)}


def listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (from /proc/net)."""
    found: set[str] = set()
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(FileNotFoundError), open(path) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.split(":")
                if state != "0A" or int(hexport, 16) != port or len(address) != width:
                    continue
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                found.add(socket.inet_ntop(family, raw))
    return found


def outward_address() -> str | None:
    """A non-loopback IPv4 address of this machine (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def with_port(env: Env, port: int, **conf: Any) -> dict[str, str]:
    """Environment for one worker of ``env`` serving metrics on ``port``."""
    return {"PULSE_TEST_CONF": json.dumps({**env.conf, "pulse_metrics_port": port, **conf})}


@pytest.fixture
def menv(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    env = make_env(pg_url, rabbitmq_url, dict(FAST))
    env.app = "tests.apps.opsapp"
    return env


@contextlib.contextmanager
def client(env: Env) -> Iterator[Celery]:
    app = Celery("metrics-client", broker=env.broker_url, set_as_current=False)
    app.conf.task_default_queue = env.queue
    try:
        yield app
    finally:
        app.close()


# -- the bind address -------------------------------------------------------------------------
@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_exporter_listens_on_pulse_metrics_address_only(
        menv: Env, workers: Callable[..., Worker], address: str) -> None:
    """Passes if the worker answers on ``address`` and its one listening socket is bound
    to that address (not the wildcard), and a non-loopback address of the machine, if
    it has one, is refused."""
    port = free_port(address)
    host = f"[{address}]" if ":" in address else address
    w = workers(menv, "ma@%h", extra_env=with_port(menv, port, pulse_metrics_address=address))
    w.wait_ready(60)
    samples = wait_alive(lambda: scrape(f"http://{host}:{port}/metrics"), 30,
                         f"metrics on {host}:{port}", (w,))
    assert value(samples, "pulse_is_leader", worker=w.wait_log(r"registered (\S+)").group(1)
                 ) is not None
    assert listening(port) == {address}
    other = outward_address()
    if other is not None and ":" not in address:
        assert scrape(f"http://{other}:{port}/metrics", timeout=2) is None
    assert "Prometheus metrics on http://" + f"{host}:{port}/metrics" in w.log()


@pytest.mark.parametrize(("address", "why"), [
    ("not an address!", "expected an IP address"),
    ("198.51.100.1", "cannot serve Prometheus metrics on 198.51.100.1"),
])
def test_bad_metrics_address_fails_at_startup_naming_the_setting(
        menv: Env, workers: Callable[..., Worker], address: str, why: str) -> None:
    """A malformed address, and one that is not this machine's, each stop the worker
    with exit code 78 and one line naming ``pulse_metrics_address``."""
    w = workers(menv, "mb@%h", extra_env=with_port(menv, free_port(),
                                                   pulse_metrics_address=address))
    assert w.wait(60) == 78
    line = next(x for x in w.log().splitlines() if x.startswith("celery-pulse: cannot start"))
    assert "pulse_metrics_address" in line and why in line, line


# -- the cluster families: on the leader only -------------------------------------------------
def test_cluster_families_on_the_leader_only_with_review_size_and_growing_age(
        menv: Env, workers: Callable[..., Worker]) -> None:
    """Worker A (the leader) runs a default-acks task; B joins. Passes if only A exports
    the cluster families (B exports none, and ``pulse_is_cluster_exporter`` sums to 1) with
    one running claim and the leader's epoch as the store has it; then, A SIGKILLed, B
    sends the task to review, leads, and exports review size 1 and an oldest-review age
    that grows between two scrapes, by the store's clock."""
    ports = free_port(), free_port()
    a = workers(menv, "la@%h", extra_env=with_port(menv, ports[0])).wait_ready(60)
    name_a = a.wait_log(r"registered (\S+)").group(1)
    url_a, url_b = (f"http://127.0.0.1:{p}/metrics" for p in ports)
    wait_alive(lambda: (s := scrape(url_a)) and value(s, "pulse_store_up") == 1.0, 30,
               "A to lead and export the cluster", (a,))
    marker = menv.tmp / "hold.txt"
    with client(menv) as app:
        task = app.send_task("opsapp.hold", args=[120, str(marker)])
    wait_for(lambda: marker.exists() and "start" in marker.read_text(), 30, "the task to start")
    b = workers(menv, "lb@%h", extra_env=with_port(menv, ports[1])).wait_ready(60)
    name_b = b.wait_log(r"registered (\S+)").group(1)

    def both() -> tuple[Samples, Samples] | None:
        sa_, sb = scrape(url_a), scrape(url_b)
        if sa_ is None or sb is None or value(sa_, "pulse_cluster_claims", state="running") != 1:
            return None
        return sa_, sb
    leader, other = wait_alive(both, 30, "both workers to answer", (a, b))
    assert cluster_names(other) == set(), "a non-leader must export no cluster family"
    assert value(other, "pulse_is_cluster_exporter", worker=name_b) == 0.0
    assert value(leader, "pulse_is_cluster_exporter", worker=name_a) == 1.0
    assert value(leader, "pulse_is_leader", worker=name_a) == 1.0
    assert value(leader, "pulse_cluster_review_size") == 0.0
    assert value(leader, "pulse_cluster_claims", state="needs_review") == 0.0  # shown at 0
    assert value(leader, "pulse_cluster_review_oldest_age_seconds") == 0.0
    assert value(leader, "pulse_cluster_retention_lag_seconds") == 0.0  # nothing past it
    assert value(other, "pulse_retention_purged_per_second", worker=name_b) == 0.0
    epoch = _leader_epoch(menv.store_url)
    assert value(leader, "pulse_cluster_leader_epoch", key="beat") == epoch

    a.kill()

    def in_review() -> Samples | None:
        s = scrape(url_b)
        return s if s and value(s, "pulse_cluster_review_size") == 1.0 else None
    first = wait_alive(in_review, 60, "B to lead and show the task in review", (b,))
    assert value(first, "pulse_cluster_claims", state="needs_review") == 1.0
    assert value(first, "pulse_is_cluster_exporter", worker=name_b) == 1.0
    assert value(first, "pulse_cluster_leader_epoch", key="beat") == _leader_epoch(
        menv.store_url) > epoch
    age = value(first, "pulse_cluster_review_oldest_age_seconds")
    assert age is not None and age > 0
    # The age grows with the store clock, between reads as well as across them.
    def grown() -> Samples | None:
        s = scrape(url_b)
        older = s and value(s, "pulse_cluster_review_oldest_age_seconds")
        return s if older and older >= age + 1.0 else None
    later: Samples = wait_for(grown, 10, "the oldest review item's age to grow")
    since = _review_since(menv.store_url, task.id)
    store_age = _store_now(menv.store_url) - since
    shown = value(later, "pulse_cluster_review_oldest_age_seconds")
    assert shown is not None and abs(store_age - shown) < 3.0, (store_age, shown)


def _one(store_url: str, sql: str, **params: Any) -> Any:
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar_one()
    finally:
        engine.dispose()


def _leader_epoch(store_url: str) -> int:
    return int(_one(store_url, "select epoch from pulse_leaders where key = 'beat'"))


def _review_since(store_url: str, task_id: str) -> float:
    """When Recover moved the claim to review (it records that as ``finished_at``)."""
    return float(_one(store_url, "select finished_at from pulse_claims "
                      "where task_id = :id and state = 'needs_review'", id=task_id))


def _store_now(store_url: str) -> float:
    return float(_one(store_url, "select extract(epoch from clock_timestamp())"))


# -- permits ------------------------------------------------------------------------------------
def test_permit_gauges_show_waiting_tasks_per_worker_and_the_cluster(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """Limit 2 on ``permitapp.gated``, 5 tasks on one worker ``-c 4``. Passes if the
    worker exports ``pulse_permit_waiting{key}`` 3 and the cluster families limit 2,
    held 2, waiting 3 for the key, and 0 held, 0 waiting once the tasks end."""
    env = make_env(pg_url, rabbitmq_url, {**FAST, "pulse_concurrency_limits": {GATED: 2}})
    env.app = "tests.apps.permitapp"
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    w = workers(env, "mp@%h", concurrency=4, extra_env=with_port(env, port)).wait_ready(60)
    name = w.wait_log(r"registered (\S+)").group(1)
    journal, gates = tmp_path / "journal.txt", tmp_path / "gates"
    gates.mkdir()
    key = f"task:{GATED}"
    with client(env) as app:
        for _ in range(5):
            app.send_task(GATED, (str(journal), str(gates), 60))

    def waiting() -> Samples | None:
        s = scrape(url)
        return s if s and value(s, "pulse_cluster_permit_waiting", key=key) == 3.0 and (
            value(s, "pulse_permit_waiting", worker=name, key=key) == 3.0) else None
    shown = wait_alive(waiting, 40, "3 tasks waiting for the permit", (w,), interval=0.3)
    assert value(shown, "pulse_cluster_permit_limit", key=key) == 2.0
    assert value(shown, "pulse_cluster_permit_held", key=key) == 2.0
    (gates / "all").touch()

    def free() -> Samples | None:
        s = scrape(url)
        return s if s and value(s, "pulse_cluster_claims", state="succeeded") == 5.0 and (
            value(s, "pulse_cluster_permit_held", key=key) == 0.0) else None
    done = wait_alive(free, 60, "every task to end and give its permit back", (w,),
                      interval=0.3)
    assert value(done, "pulse_cluster_permit_waiting", key=key) == 0.0
    assert value(done, "pulse_permit_waiting", worker=name, key=key) in (None, 0.0)


# -- a hung store -------------------------------------------------------------------------------
def test_a_hung_store_never_hangs_a_scrape_and_shows_store_down(
        menv: Env, workers: Callable[..., Worker]) -> None:
    """While another session holds an exclusive lock on ``pulse_claims`` (every read of
    it waits), passes if every scrape answers within a second, ``pulse_store_up`` turns
    0 and the cluster's other figures disappear; once the lock goes, it is 1 again."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    w = workers(menv, "mh@%h", extra_env=with_port(menv, port)).wait_ready(60)
    wait_alive(lambda: (s := scrape(url)) and value(s, "pulse_store_up") == 1.0, 30,
               "the store to be up", (w,))
    engine = sa.create_engine(menv.store_url, poolclass=sa.pool.NullPool)
    conn = engine.connect()
    try:
        trans = conn.begin()
        conn.execute(sa.text("lock table pulse_claims in access exclusive mode"))
        slowest = 0.0

        def down() -> Samples | None:
            nonlocal slowest
            began = time.monotonic()
            s = scrape(url, timeout=10)
            slowest = max(slowest, time.monotonic() - began)
            return s if s and value(s, "pulse_store_up") == 0.0 else None
        shown = wait_alive(down, 30, "pulse_store_up 0 while the store hangs", (w,),
                           interval=0.2)
        assert cluster_names(shown) == {"pulse_store_up"}
        print(f"\nslowest scrape while the store hung: {slowest * 1000:.1f} ms")
        assert slowest < 1.0
        trans.rollback()
    finally:
        conn.close()
        engine.dispose()
    wait_alive(lambda: (s := scrape(url)) and value(s, "pulse_store_up") == 1.0, 30,
               "the store to be up again", (w,))


def test_with_beat_off_one_worker_elected_for_metrics_exports_the_cluster(
        menv: Env, workers: Callable[..., Worker]) -> None:
    """``pulse_beat = False``: nobody leads beat. Passes if the two workers elect one
    exporter over the ``metrics`` leader key: exactly one exports the cluster families
    (with that key's epoch), the other none, and neither claims to lead beat."""
    menv.conf["pulse_beat"] = False
    ports = free_port(), free_port()
    ws = tuple(workers(menv, f"nb{i}@%h", extra_env=with_port(menv, port)).wait_ready(60)
               for i, port in enumerate(ports))
    urls = [f"http://127.0.0.1:{port}/metrics" for port in ports]

    def split() -> list[Samples] | None:
        got = [scrape(url) for url in urls]
        if any(s is None for s in got):
            return None
        answers = [s for s in got if s is not None]
        ups = [value(s, "pulse_store_up") for s in answers]
        return answers if ups.count(1.0) == 1 and ups.count(None) == 1 else None
    answers = wait_alive(split, 30, "one worker to export the cluster", ws)
    exporter = next(s for s in answers if value(s, "pulse_store_up") == 1.0)
    other = next(s for s in answers if value(s, "pulse_store_up") is None)
    assert cluster_names(other) == set()
    assert value(exporter, "pulse_cluster_leader_epoch", key="metrics") is not None
    assert value(exporter, "pulse_cluster_leader_epoch", key="beat") is None
    for s in answers:
        assert sum(v for (name, _l), v in s.items() if name == "pulse_is_leader") == 0.0
    assert sum(v for s in answers for (name, _l), v in s.items()
               if name == "pulse_is_cluster_exporter") == 1.0
