"""Optional Prometheus export of the same figures as the ``pulse`` stats section."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.metrics")


def serve(port: int, info: Callable[[], dict[str, Any]]) -> bool:
    """Start an HTTP exporter on ``port``; False (with a log line) if unavailable."""
    try:
        from prometheus_client import REGISTRY, start_http_server
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        logger.error("pulse: pulse_metrics_port is set but prometheus_client is not installed "
                     "(pip install prometheus_client)")
        return False

    class Collector:
        def collect(self) -> Iterator[Any]:
            data = info()
            labels = ["worker"]
            worker = [str(data["worker_id"])]
            for name, value in data["counts"].items():
                family = CounterMetricFamily(f"pulse_{name}", f"pulse {name} count", labels=labels)
                family.add_metric(worker, value)
                yield family
            for name, value in data["leases"].items():
                gauge = GaugeMetricFamily(f"pulse_leases_{name}", f"pulse leases {name}",
                                          labels=labels)
                gauge.add_metric(worker, value)
                yield gauge
            for name, value in data["recover"].items():
                family = CounterMetricFamily(f"pulse_recover_{name}", f"pulse recover {name}",
                                             labels=labels)
                family.add_metric(worker, value)
                yield family
            leader = data.get("leader") or {}
            gauge = GaugeMetricFamily("pulse_is_leader", "1 if this worker leads beat",
                                      labels=labels)
            gauge.add_metric(worker, 1.0 if leader.get("is_leader") else 0.0)
            yield gauge
            p99 = data["renew_latency"].get("p99")
            if p99 is not None:
                gauge = GaugeMetricFamily("pulse_renew_latency_p99_seconds",
                                          "p99 of recent renewal round trips", labels=labels)
                gauge.add_metric(worker, p99)
                yield gauge

    REGISTRY.register(Collector())
    start_http_server(port)
    logger.info("pulse: Prometheus metrics on :%d/metrics", port)
    return True
