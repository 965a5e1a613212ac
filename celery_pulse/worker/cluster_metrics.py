"""The cluster's figures for Prometheus, read from the store by one worker only.

Rules:

* Only the exporter reads: the worker for which ``is_exporter()`` is true (the beat
  leader, or with ``pulse_beat`` off the holder of the ``metrics`` leader key). Every
  other worker exports none of the cluster families, so a ``sum()`` over workers is
  the cluster's figure, not that figure times the number of workers.
* The reads run on this service's own thread every ``interval`` seconds, never in a
  scrape: a scrape only copies the last :class:`ClusterSnapshot`, so a slow or hung
  store can neither hang a scrape nor any of the worker's own threads.
* A failed read, or a read older than :meth:`ClusterReader.stale_after` (the store
  hangs), makes the store down for Prometheus (``pulse_store_up 0``) and drops the
  other cluster families: an old figure shown as current would mislead an alert.
* Ages are by the store's clock: the read keeps the store's ``now()`` and the local
  monotonic time it was taken at, and a scrape projects the store clock forward by the
  monotonic time elapsed since, so an age grows between two reads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_pulse.leader import LeaderElector
from celery_pulse.service import Service
from celery_pulse.settings import Settings
from celery_pulse.store.base import LIVE_STATES, NEEDS_REVIEW, OPEN, TERMINAL_STATES, PermitUsage

logger = logging.getLogger(__name__)

#: Every state the claims family shows, 0 included (an absent series would hide a 0 from
#: an alert); ``expired``: live claims past their lease.
CLAIM_STATES = (*LIVE_STATES, OPEN, *TERMINAL_STATES, "expired")

#: The leader key workers campaign for to choose the exporter when ``pulse_beat`` is off.
METRICS_KEY = "metrics"


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """One read of the cluster's figures (``ok`` False: the read failed, figures empty)."""

    ok: bool
    #: ``time.monotonic()`` when the read finished.
    read_at: float
    #: The store clock at the read (seconds since the epoch; 0.0 when the read failed).
    store_now: float = 0.0
    claims: dict[str, int] = dataclasses.field(default_factory=dict)
    #: ``since`` of the oldest item in review (store clock), None when there is none.
    oldest_review: float | None = None
    #: Leader key -> epoch of its current (or last) holder.
    leader_epochs: dict[str, int] = dataclasses.field(default_factory=dict)
    permits: tuple[PermitUsage, ...] = ()
    #: How long the read took (seconds).
    duration: float = 0.0
    #: Seconds the oldest finished claim is past ``pulse_retention`` (None: not read).
    retention_lag: float | None = None


def oldest_review_since(store: Any) -> float | None:
    """When the task longest in review entered it, by the store clock.

    The store records that time (revision 0011); a claim moved to review before then has
    none, and the oldest reservation among the review items stands in for it.
    """
    since = store.oldest_review_since()
    if since is not None:
        return float(since)
    items = store.list_review(limit=1)
    return float(items[0].since) if items else None


def read_cluster(store: Any, leader_keys: tuple[str, ...],
                 monotonic: Callable[[], float] = time.monotonic,
                 retention: float | None = None) -> ClusterSnapshot:
    """Read every cluster figure from ``store`` (raises what the store raises)."""
    began = monotonic()
    now = float(store.now())
    claims = dict.fromkeys(CLAIM_STATES, 0)
    claims.update((str(state), int(n)) for state, n in store.claim_counts().items())
    oldest = oldest_review_since(store) if claims.get(NEEDS_REVIEW) else None
    epochs = {}
    for key in leader_keys:
        info = store.get_leader(key)
        if info is not None:
            epochs[key] = int(info.epoch)
    permits = tuple(store.permit_usage())
    lag = None if retention is None else float(store.retention_lag(retention))
    done = monotonic()
    return ClusterSnapshot(True, done, now, claims, oldest, epochs, permits, done - began, lag)


def exporter_for(store: Any, elector: LeaderElector | None, hostname: str,
                 settings: Settings) -> tuple[ClusterReader, LeaderElector | None]:
    """A worker's cluster reader, exporting while ``elector`` (beat's) leads, and with
    beat off (``elector`` None) the election of its own over :data:`METRICS_KEY`."""
    own: LeaderElector | None = None
    if elector is None:
        own = campaign = LeaderElector(store, METRICS_KEY, hostname, ttl=settings.leader_ttl,
                                       interval=settings.leader_interval,
                                       margin=settings.leader_margin)
    else:
        campaign = elector
    reader = ClusterReader(store, lambda: campaign.is_leader, interval=settings.metrics_interval,
                           leader_keys=(campaign.key,), retention=settings.retention)
    return reader, own


class ClusterReader(Service):
    """Reads the cluster's figures every ``interval`` while this worker is the exporter
    (thread ``pulse-metrics``); :meth:`snapshot` is what a scrape shows."""

    def __init__(self, store: Any, is_exporter: Callable[[], bool], *, interval: float,
                 leader_keys: tuple[str, ...], retention: float | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__("pulse-metrics", join_timeout=5.0)
        self.store = store
        self.is_exporter = is_exporter
        self.interval = interval
        self.leader_keys = leader_keys
        self.retention = retention
        self.monotonic = monotonic
        self._last: ClusterSnapshot | None = None
        #: When the read under way (or the last one) began (monotonic).
        self._began: float | None = None
        self._lock = threading.Lock()

    @property
    def stale_after(self) -> float:
        """A read older than this counts as a store that does not answer."""
        return 2 * self.interval + 5.0

    def run(self) -> None:
        while not self.stopping:
            self.read_once()
            if self.sleep(self.interval):
                return

    def read_once(self) -> None:
        """One read if this worker is the exporter (forgets the last one if not)."""
        if not self.is_exporter():
            self._set(None)
            self._began = None
            return
        self._began = self.monotonic()
        try:
            snapshot = read_cluster(self.store, self.leader_keys, self.monotonic, self.retention)
        except Exception as exc:
            logger.warning("pulse: reading the cluster's metrics from the store failed: %r",
                           exc)
            snapshot = ClusterSnapshot(False, self.monotonic())
        self._set(snapshot)

    def _set(self, snapshot: ClusterSnapshot | None) -> None:
        with self._lock:
            self._last = snapshot

    def snapshot(self) -> ClusterSnapshot | None:
        """The last read as a scrape should show it: None when this worker is not the
        exporter; a failed snapshot when the last read failed or is stale."""
        if not self.is_exporter():
            return None
        with self._lock:
            last = self._last
        now = self.monotonic()
        if last is None:  # the first read: still under way, or hung
            began = self._began
            hung = began is not None and now - began > self.stale_after
            return ClusterSnapshot(False, began) if hung and began is not None else None
        if last.ok and now - last.read_at > self.stale_after:
            return ClusterSnapshot(False, last.read_at)
        return last

    def store_clock(self, snapshot: ClusterSnapshot) -> float:
        """The store clock now, projected from ``snapshot``'s read."""
        return snapshot.store_now + max(0.0, self.monotonic() - snapshot.read_at)
