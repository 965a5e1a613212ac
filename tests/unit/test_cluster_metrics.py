"""The cluster's figures for Prometheus (celery_pulse.worker.cluster_metrics and the
collector of celery_pulse.worker.metrics) over the in-memory store and the fake clock:
who exports, when a read counts as stale, and how ages follow the store clock."""

from __future__ import annotations

import pytest

from celery_pulse.store.memory import MemoryStore
from celery_pulse.worker.cluster_metrics import CLAIM_STATES, ClusterReader
from celery_pulse.worker.metrics import PulseCollector
from tests.helpers.clock import FakeClock

core = pytest.importorskip("prometheus_client.core")


def reader(store: MemoryStore, clock: FakeClock, exporter: list[bool]) -> ClusterReader:
    return ClusterReader(store, lambda: exporter[0], interval=1.0, leader_keys=("beat",),
                         monotonic=clock)


def test_a_worker_that_does_not_export_reads_nothing_and_shows_nothing() -> None:
    clock = FakeClock()
    cluster = reader(MemoryStore(clock), clock, [False])
    cluster.read_once()
    assert cluster.snapshot() is None


def test_the_exporter_shows_every_claim_state_and_the_leader_epoch() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    grant = store.try_acquire("beat", "w1", ttl=10)
    assert grant is not None
    cluster = reader(store, clock, [True])
    cluster.read_once()
    snap = cluster.snapshot()
    assert snap is not None and snap.ok
    assert snap.claims == dict.fromkeys(CLAIM_STATES, 0)
    assert snap.leader_epochs == {"beat": grant.epoch}
    assert snap.oldest_review is None


def test_a_read_older_than_stale_after_is_a_store_down() -> None:
    clock = FakeClock()
    cluster = reader(MemoryStore(clock), clock, [True])
    cluster.read_once()
    clock.advance(cluster.stale_after - 0.1)
    snap = cluster.snapshot()
    assert snap is not None and snap.ok
    assert cluster.store_clock(snap) == pytest.approx(snap.store_now + cluster.stale_after - 0.1)
    clock.advance(0.2)
    stale = cluster.snapshot()
    assert stale is not None and not stale.ok


def test_losing_the_export_forgets_the_last_read() -> None:
    clock = FakeClock()
    exporter = [True]
    cluster = reader(MemoryStore(clock), clock, exporter)
    cluster.read_once()
    exporter[0] = False
    cluster.read_once()
    exporter[0] = True
    assert cluster.snapshot() is None  # nothing shown until a read of its own


def _names(collector: PulseCollector) -> set[str]:
    return {family.name for family in collector.collect()}


def test_the_collector_yields_cluster_families_on_the_exporter_only() -> None:
    clock = FakeClock()
    exporter = [False]
    cluster = reader(MemoryStore(clock), clock, exporter)
    info = {"worker_id": "w1", "counts": {"lost": 0}, "leases": {"held": 0},
            "recover": {"needs_review": 0}, "leader": None, "renew_latency": {},
            "permits": {"waiting": 2, "by_key": {"task:t": 2}, "awaiting_process": 0}}
    collector = PulseCollector(lambda: info, cluster,
                               (core.CounterMetricFamily, core.GaugeMetricFamily))
    cluster.read_once()
    names = _names(collector)
    assert "pulse_permit_waiting" in names
    assert not {n for n in names if n.startswith(("pulse_cluster_", "pulse_store_up"))}
    exporter[0] = True
    cluster.read_once()
    names = _names(collector)
    assert {"pulse_store_up", "pulse_cluster_claims", "pulse_cluster_review_size",
            "pulse_cluster_review_oldest_age_seconds", "pulse_cluster_leader_epoch",
            "pulse_cluster_permit_limit", "pulse_cluster_permit_held",
            "pulse_cluster_permit_waiting"} <= names
    clock.advance(cluster.stale_after + 1)
    names = _names(collector)
    assert {n for n in names if n.startswith(("pulse_cluster_", "pulse_store_up"))} == {
        "pulse_store_up"}
