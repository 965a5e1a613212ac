"""Optional Prometheus export: this worker's figures (its ``pulse`` stats section) and,
on the one worker that reads them, the cluster's (:mod:`celery_pulse.worker.cluster_metrics`).

A scrape never touches the store: the worker's families come from memory, the
cluster's from the last background read. Every family is documented in
docs/monitoring.md ("Prometheus"); a new one goes there too.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

from celery_pulse.errors import InvalidConfig
from celery_pulse.worker.cluster_metrics import ClusterReader, ClusterSnapshot

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.metrics")

#: prometheus_client's metric family classes, imported with it.
Families = tuple[Any, Any]


class PulseCollector:
    """A prometheus_client collector over ``info()`` (the stats section) and ``cluster``."""

    def __init__(self, info: Callable[[], dict[str, Any]], cluster: ClusterReader | None,
                 families: Families) -> None:
        self.info = info
        self.cluster = cluster
        self.counter, self.gauge = families

    def collect(self) -> Iterator[Any]:
        yield from self.worker_families(self.info())
        snapshot = self.cluster.snapshot() if self.cluster is not None else None
        if self.cluster is not None and snapshot is not None:
            yield from self.cluster_families(self.cluster, snapshot)

    def _one(self, kind: Any, name: str, doc: str, worker: str, value: float) -> Any:
        family = kind(name, doc, labels=["worker"])
        family.add_metric([worker], value)
        return family

    def worker_families(self, data: dict[str, Any]) -> Iterator[Any]:
        worker = str(data["worker_id"])
        for name, value in data["counts"].items():
            yield self._one(self.counter, f"pulse_{name}", f"pulse {name} count", worker, value)
        for name, value in data["leases"].items():
            yield self._one(self.gauge, f"pulse_leases_{name}", f"pulse leases {name}", worker,
                            value)
        for name, value in data["recover"].items():
            yield self._one(self.counter, f"pulse_recover_{name}", f"pulse recover {name}",
                            worker, value)
        retention = data.get("retention") or {}
        if retention.get("lag") is not None:  # this worker purges
            yield self._one(self.gauge, "pulse_retention_lag_seconds", "Seconds the oldest "
                            "finished claim is past pulse_retention, after the last purge",
                            worker, retention["lag"])
        yield self._one(self.gauge, "pulse_retention_purged_per_second", "Finished claims "
                        "this worker purged per second over the last minute", worker,
                        retention.get("purged_per_second", 0.0))
        leader = data.get("leader") or {}
        yield self._one(self.gauge, "pulse_is_leader", "1 if this worker leads beat", worker,
                        1.0 if leader.get("is_leader") else 0.0)
        p99 = data["renew_latency"].get("p99")
        if p99 is not None:
            yield self._one(self.gauge, "pulse_renew_latency_p99_seconds",
                            "p99 of recent renewal round trips", worker, p99)
        permits = data.get("permits") or {}
        waiting = self.gauge("pulse_permit_waiting",
                             "Tasks of this worker waiting for a concurrency permit, by key",
                             labels=["worker", "key"])
        for key, count in sorted((permits.get("by_key") or {}).items()):
            waiting.add_metric([worker, key], count)
        yield waiting
        yield self._one(self.gauge, "pulse_permit_awaiting_process",
                        "Tasks holding their permits and waiting for a pool process", worker,
                        permits.get("awaiting_process", 0))
        exporter = self.cluster is not None and self.cluster.is_exporter()
        yield self._one(self.gauge, "pulse_is_cluster_exporter",
                        "1 if this worker exports the pulse_cluster_* families", worker,
                        1.0 if exporter else 0.0)

    def cluster_families(self, cluster: ClusterReader, snap: ClusterSnapshot) -> Iterator[Any]:
        up = self.gauge("pulse_store_up", "1 if the last read of the cluster's figures from "
                        "the store succeeded in time")
        up.add_metric([], 1.0 if snap.ok else 0.0)
        yield up
        if not snap.ok:
            return
        yield self._plain("pulse_cluster_read_age_seconds",
                          "Seconds since the cluster's figures were read",
                          max(0.0, cluster.monotonic() - snap.read_at))
        yield self._plain("pulse_cluster_read_duration_seconds",
                          "How long the last read of the cluster's figures took", snap.duration)
        claims = self.gauge("pulse_cluster_claims", "Claims in the store by state (expired: "
                            "live claims past their lease)", labels=["state"])
        for state, count in sorted(snap.claims.items()):
            claims.add_metric([state], count)
        yield claims
        yield self._plain("pulse_cluster_review_size", "Tasks waiting in review",
                          snap.claims.get("needs_review", 0))
        age = (0.0 if snap.oldest_review is None
               else max(0.0, cluster.store_clock(snap) - snap.oldest_review))
        yield self._plain("pulse_cluster_review_oldest_age_seconds",
                          "Age of the oldest task waiting in review by the store clock "
                          "(0: none)", age)
        if snap.retention_lag is not None:
            yield self._plain("pulse_cluster_retention_lag_seconds",
                              "Seconds the oldest finished claim is past pulse_retention by "
                              "the store clock (0: retention keeps up)", snap.retention_lag)
        epochs = self.gauge("pulse_cluster_leader_epoch", "Epoch of the leadership lease",
                            labels=["key"])
        for key, epoch in sorted(snap.leader_epochs.items()):
            epochs.add_metric([key], epoch)
        yield epochs
        for name, doc, attr in (("limit", "Concurrency limit", "limit"),
                                ("held", "Running claims holding a permit (a rate: starts "
                                          "in its window)", "running"),
                                ("waiting", "Reserved claims waiting for a permit", "waiting")):
            family = self.gauge(f"pulse_cluster_permit_{name}", f"{doc}, by key",
                                labels=["key"])
            for usage in snap.permits:
                family.add_metric([usage.key], getattr(usage, attr))
            yield family

    def _plain(self, name: str, doc: str, value: float) -> Any:
        family = self.gauge(name, doc)
        family.add_metric([], value)
        return family


def serve(address: str, port: int, info: Callable[[], dict[str, Any]],
          cluster: ClusterReader | None = None) -> bool:
    """Start an HTTP exporter on ``address``:``port``; False (with a log line) if
    prometheus_client is not installed. A socket that cannot be bound is a bad
    setting: :class:`InvalidConfig` naming ``pulse_metrics_address`` (or the port)."""
    try:
        from prometheus_client import REGISTRY, start_http_server
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        logger.error("pulse: pulse_metrics_port is set but prometheus_client is not installed "
                     "(pip install prometheus_client)")
        return False
    try:
        start_http_server(port, addr=address)
    except OSError as exc:
        setting = ("pulse_metrics_port" if exc.errno in (errno.EADDRINUSE, errno.EACCES)
                   else "pulse_metrics_address")
        why = exc.strerror or str(exc)
        if isinstance(exc, socket.gaierror):
            why = f"cannot resolve it ({why})"
        raise InvalidConfig(f"{setting}: cannot serve Prometheus metrics on "
                            f"{_where(address, port)}: {why}", setting=setting) from exc
    REGISTRY.register(PulseCollector(info, cluster, (CounterMetricFamily, GaugeMetricFamily)))
    logger.info("pulse: Prometheus metrics on http://%s/metrics", _where(address, port))
    return True


def _where(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
