"""The ``pulse_*`` settings, read once into a frozen object and validated.

Nothing else in the package reads ``app.conf`` for a ``pulse_*`` key: bootsteps
and commands get a :class:`Settings`. A bad value fails here, at startup, with an
:class:`InvalidConfig` that names the setting — never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from celery_pulse.errors import InvalidConfig
from celery_pulse.limits import concurrency_limit, concurrency_limits, rate_limits
from celery_pulse.store_urls import STORE_SCHEMES, canonical_store_url, default_store_url, mask_url

ON_LOST_POLICIES = ("redispatch", "review")
#: The largest ``pulse_store_pool_size`` (more is a typo, or a pooler's job).
MAX_POOL_SIZE = 64
#: The per-task options pulse reads (``@app.task(pulse_max_attempts=3)``); a unit test
#: checks these are exactly the ``getattr(task, "pulse_...")`` names in the package.
TASK_OPTIONS = frozenset({"pulse_on_lost", "pulse_max_attempts", "pulse_idempotent",
                          "pulse_concurrency", "pulse_concurrency_key", "pulse_rate_limit",
                          "pulse_rate_limit_key"})
__all__ = ["TASK_OPTIONS", "Settings", "concurrency_limit"]


def _doc(text: str, default: str) -> dict[str, str]:
    return {"doc": text, "default": default}


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Validated pulse configuration. Durations are in seconds."""

    store_url: str = dataclasses.field(
        default_factory=default_store_url,
        metadata=_doc("SQLAlchemy URL of the store (PostgreSQL via psycopg 3, whether the "
                      "URL says `postgres://`, `postgresql://` or `postgresql+psycopg://`; "
                      "MySQL/MariaDB via PyMySQL unless the URL names mysqldb or "
                      "mariadbconnector, or SQLite).",
                      "SQLite file ./.celery-pulse/pulse.sqlite3"),
    )
    database: str | None = dataclasses.field(
        default=None, metadata=_doc("A Django `DATABASES` alias: the store is that database, "
                                    "through pulse's own connections (Django settings: "
                                    "`CELERY_PULSE_DATABASE`; docs/django.md). "
                                    "`pulse_store_url` wins.", "None"))
    worker_ttl: float = dataclasses.field(
        default=30.0, metadata=_doc("How long a worker registration lives without heartbeat.", "30 s"))
    heartbeat_interval: float = dataclasses.field(
        default=0.0, metadata=_doc("Heartbeat period; must be < pulse_worker_ttl.", "worker_ttl / 3"))
    lease_ttl: float = dataclasses.field(
        default=30.0, metadata=_doc("How long a task lease lives without renewal.", "30 s"))
    renew_interval: float = dataclasses.field(
        default=0.0, metadata=_doc("Batched lease renewal period; must be < pulse_lease_ttl.",
                                   "lease_ttl / 3"))
    revoke_grace: float = dataclasses.field(
        default=5.0, metadata=_doc("Time a task gets after LeaseLost before it is hard-stopped.", "5 s"))
    recover_interval: float = dataclasses.field(
        default=2.0, metadata=_doc("How often a worker scans for expired claims.", "2 s"))
    recover_batch: int = dataclasses.field(
        default=100, metadata=_doc("Most claims taken over per scan.", "100"))
    retention: float = dataclasses.field(
        default=86400.0, metadata=_doc("How long finished claims are kept (duplicate window, audit).",
                                       "1 day"))
    purge_interval: float = dataclasses.field(
        default=60.0, metadata=_doc("How often retention's purge runs (one pass: every row past "
                                    "pulse_retention, in batches).", "60 s"))
    beat: bool = dataclasses.field(
        default=True, metadata=_doc("Run the leader-elected beat inside -P pulse workers.", "on"))
    beat_catchup: str = dataclasses.field(
        default="latest", metadata=_doc("After an outage: fire the most recent missed slot once "
                                        "('latest', like celery beat) or every one ('all').",
                                        "latest"))
    leader_ttl: float = dataclasses.field(
        default=15.0, metadata=_doc("Leadership lease TTL.", "15 s"))
    leader_interval: float = dataclasses.field(
        default=0.0, metadata=_doc("Leadership renewal period; must be < pulse_leader_ttl.",
                                   "leader_ttl / 3"))
    max_attempts: int = dataclasses.field(
        default=10, metadata=_doc("Reservations one publication of a task may consume before it is "
                                   "failed (a retry is a new publication).", "10"))
    on_lost: str | None = dataclasses.field(
        default=None, metadata=_doc("What Recover does with a started-then-lost task: "
                                    "'redispatch' or 'review'.",
                                    "redispatch if acks_late or pulse_idempotent, else review"))
    metrics_port: int = dataclasses.field(
        default=0, metadata=_doc("Serve Prometheus metrics on this port (needs prometheus_client); "
                                 "0 = off.", "0 (off)"))
    metrics_address: str = dataclasses.field(
        default="0.0.0.0", metadata=_doc("The address the Prometheus exporter listens on: an IP "
                                         "address (IPv6 too: `::1`, `::`) or a host name; "
                                         "`127.0.0.1` keeps it on the host.", "0.0.0.0 (every "
                                         "IPv4 interface)"))
    metrics_interval: float = dataclasses.field(
        default=15.0, metadata=_doc("How often the exporting worker reads the cluster's figures "
                                    "(the `pulse_cluster_*` metrics) from the store.", "15 s"))
    store_connect_timeout: float = dataclasses.field(
        default=10.0, metadata=_doc("How long startup waits for an unreachable store.", "10 s"))
    store_pool_size: int = dataclasses.field(
        default=4, metadata=_doc("The most pooled store connections a process keeps (the "
                                 "worker's parent, Flower, the gateway, a command, the "
                                 "pulse:// backend), 1 to 64; a pool child keeps 1. See "
                                 "[Connections per worker](production.md#connections-per-worker)"
                                 ".", "4"))
    store_pooler: str = dataclasses.field(
        default="auto", metadata=_doc("The pooler between pulse and PostgreSQL (PgBouncer): "
                                      "`none`, `session`, `transaction` (no session state, no "
                                      "LISTEN), or `auto`: detected at start "
                                      "(docs/production.md#pgbouncer).", "auto"))
    store_listen_url: str | None = dataclasses.field(
        default=None, metadata=_doc("A direct PostgreSQL URL (not through a transaction "
                                    "pooler) for the LISTEN connections that wake permit and "
                                    "result waiters; without it, they poll under transaction "
                                    "pooling.", "None (the store URL's pool)"))
    concurrency_limits: Mapping[str, int] = dataclasses.field(
        default_factory=dict,
        metadata=_doc("Cluster-wide concurrency limits: at most N tasks of a name "
                      "(`\"proj.tasks.charge\": 5`) or of a queue (`\"queue:payments\": 20`, "
                      "by the delivery's routing key) run at once across every worker of "
                      "the store. Overrides the tasks' `pulse_concurrency`.", "{} (none)"))
    rate_limits: Mapping[str, Any] = dataclasses.field(
        default_factory=dict,
        metadata=_doc("Cluster-wide rate limits in Celery's syntax: at most N starts of a "
                      "name (`\"proj.tasks.send\": \"100/m\"`) or of a queue "
                      "(`\"queue:emails\": \"300/m\"`) in any window of that length, across "
                      "every worker of the store (docs/rate-limits.md). Overrides the tasks' "
                      "`pulse_rate_limit`.", "{} (none)"))
    permit_backlog: int = dataclasses.field(
        default=256, metadata=_doc("Tasks waiting in a worker for a concurrency permit that do "
                                   "not count against its prefetch limit (past it they do).",
                                   "256"))
    permit_wait_event: float = dataclasses.field(
        default=60.0, metadata=_doc("Send a `pulse-permit-wait` event for a task that has "
                                    "waited this long for a concurrency permit.", "60 s"))
    gateway_url: str | None = dataclasses.field(
        default=None, metadata=_doc("A worker that talks only to a lease gateway "
                                    "(`wss://host:8443/v1/worker/connect`): it holds no "
                                    "database or broker credentials (docs/gateway.md).",
                                    "None (a direct worker)"))
    gateway_credentials: str | None = dataclasses.field(
        default=None, metadata=_doc("With pulse_gateway_url: the credentials file `celery "
                                    "pulse credentials create --output` wrote.", "None"))
    gateway_ca: str | None = dataclasses.field(
        default=None, metadata=_doc("With pulse_gateway_url: a CA bundle (PEM) to check the "
                                    "gateway's certificate against.", "the system's"))

    def __post_init__(self) -> None:
        # Derived defaults: an interval left at 0 means "a third of its TTL".
        for interval, ttl in (("heartbeat_interval", "worker_ttl"),
                              ("renew_interval", "lease_ttl"),
                              ("leader_interval", "leader_ttl")):
            if getattr(self, interval) == 0.0:
                object.__setattr__(self, interval, getattr(self, ttl) / 3.0)
        object.__setattr__(self, "store_url", canonical_store_url(self.store_url))
        object.__setattr__(self, "concurrency_limits",
                           concurrency_limits("pulse_concurrency_limits", self.concurrency_limits))
        object.__setattr__(self, "rate_limits", rate_limits("pulse_rate_limits",
                                                            self.rate_limits))
        self._validate()

    def _validate(self) -> None:
        scheme = urlsplit(self.store_url).scheme
        if scheme not in STORE_SCHEMES:
            raise InvalidConfig(
                f"pulse_store_url: unknown scheme {scheme!r} in {mask_url(self.store_url)!r}; "
                f"use one of {', '.join(STORE_SCHEMES)}", setting="pulse_store_url")
        for name in ("worker_ttl", "lease_ttl", "leader_ttl", "heartbeat_interval",
                     "renew_interval", "leader_interval", "recover_interval", "retention",
                     "purge_interval", "store_connect_timeout", "metrics_interval"):
            if getattr(self, name) <= 0:
                raise InvalidConfig(f"pulse_{name} must be > 0, got {getattr(self, name)!r}",
                                    setting=f"pulse_{name}")
        if self.revoke_grace < 0:
            raise InvalidConfig("pulse_revoke_grace must be >= 0", setting="pulse_revoke_grace")
        for interval, ttl in (("heartbeat_interval", "worker_ttl"),
                              ("renew_interval", "lease_ttl"),
                              ("leader_interval", "leader_ttl")):
            if getattr(self, interval) >= getattr(self, ttl):
                raise InvalidConfig(
                    f"pulse_{interval} ({getattr(self, interval)}s) must be shorter than "
                    f"pulse_{ttl} ({getattr(self, ttl)}s)", setting=f"pulse_{interval}")
        object.__setattr__(self, "metrics_address", _listen_address(self.metrics_address))
        if not 0 <= self.metrics_port < 65536:
            raise InvalidConfig("pulse_metrics_port must be a TCP port (0 = off)",
                                setting="pulse_metrics_port")
        if self.permit_wait_event <= 0:
            raise InvalidConfig("pulse_permit_wait_event must be > 0",
                                setting="pulse_permit_wait_event")
        for name in ("recover_batch", "max_attempts", "permit_backlog"):
            if getattr(self, name) < 1:
                raise InvalidConfig(f"pulse_{name} must be >= 1", setting=f"pulse_{name}")
        if not 1 <= self.store_pool_size <= MAX_POOL_SIZE:
            raise InvalidConfig(f"pulse_store_pool_size must be between 1 and {MAX_POOL_SIZE}, "
                                f"got {self.store_pool_size!r}", setting="pulse_store_pool_size")
        if self.beat_catchup not in ("latest", "all"):
            raise InvalidConfig(f"pulse_beat_catchup must be 'latest' or 'all', got "
                                f"{self.beat_catchup!r}", setting="pulse_beat_catchup")
        if self.gateway_url is not None:
            if urlsplit(self.gateway_url).scheme not in ("wss", "ws"):
                raise InvalidConfig(f"pulse_gateway_url: expected a wss:// (or ws://) URL, got "
                                    f"{self.gateway_url!r}", setting="pulse_gateway_url")
            if not self.gateway_credentials or not os.path.isfile(self.gateway_credentials):
                raise InvalidConfig(f"pulse_gateway_credentials: a gateway worker needs its "
                                    f"credentials file (celery pulse credentials create "
                                    f"--output FILE); {self.gateway_credentials!r} is none",
                                    setting="pulse_gateway_credentials")
        if self.gateway_ca is not None and not os.path.isfile(self.gateway_ca):
            raise InvalidConfig(f"pulse_gateway_ca: no such file {self.gateway_ca!r}",
                                setting="pulse_gateway_ca")
        if self.store_listen_url is not None and not urlsplit(
                self.store_listen_url).scheme.startswith("postgres"):
            raise InvalidConfig(f"pulse_store_listen_url: expected a PostgreSQL URL, got "
                                f"{mask_url(self.store_listen_url)!r}",
                                setting="pulse_store_listen_url")
        if self.store_pooler not in ("auto", "none", "session", "transaction"):
            raise InvalidConfig(f"pulse_store_pooler must be auto, none, session or "
                                f"transaction, got {self.store_pooler!r}",
                                setting="pulse_store_pooler")
        if self.database is not None and not (isinstance(self.database, str) and self.database):
            raise InvalidConfig("pulse_database must name a Django DATABASES alias",
                                setting="pulse_database")
        if self.on_lost is not None and self.on_lost not in ON_LOST_POLICIES:
            raise InvalidConfig(f"pulse_on_lost must be one of {ON_LOST_POLICIES}, "
                                f"got {self.on_lost!r}", setting="pulse_on_lost")

    @property
    def safety_margin(self) -> float:
        """Slack subtracted from a task lease's local self-fence deadline (drift, GC)."""
        return min(1.0, self.lease_ttl / 10.0)

    @property
    def worker_margin(self) -> float:
        """The same slack for the worker registration."""
        return min(1.0, self.worker_ttl / 10.0)

    @property
    def leader_margin(self) -> float:
        """The same slack for leadership."""
        return min(1.0, self.leader_ttl / 10.0)

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> Settings:
        """Read every ``pulse_*`` key of a Celery ``app.conf`` (or any mapping).

        A ``pulse_*`` key that is not a setting (a typo) is refused, not ignored."""
        refuse_unknown(conf)
        kwargs: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            key = f"pulse_{field.name}"
            value = conf.get(key)
            if value is None:
                continue
            kwargs[field.name] = _coerce(key, value, field.type)
        if kwargs.get("database") and "store_url" not in kwargs:  # Django read on demand
            from celery_pulse.contrib.django.database import store_url

            kwargs["store_url"] = store_url(kwargs["database"])
        return cls(**kwargs)


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _listen_address(value: str) -> str:
    """``pulse_metrics_address`` checked: an IP address (``[::1]`` loses its brackets)
    or a host name; anything else is refused now, not when the socket binds."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if len(text) <= 253 and _HOST_NAME.fullmatch(text) and not text.replace(".", "").isdigit():
        return text
    raise InvalidConfig(f"pulse_metrics_address: expected an IP address (0.0.0.0, 127.0.0.1, "
                        f"::1) or a host name, got {value!r}", setting="pulse_metrics_address")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("Mapping"):
        return (rate_limits if key == "pulse_rate_limits" else concurrency_limits)(key, value)
    try:
        if text == "float":
            if isinstance(value, timedelta):
                return value.total_seconds()
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if text == "int":
            if isinstance(value, bool) or float(value) != int(value):
                raise TypeError
            return int(value)
        if text == "bool":
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            return bool(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise InvalidConfig(f"{key}: invalid value {value!r} (expected {text})",
                            setting=key) from None


def known_settings() -> frozenset[str]:
    """Every setting pulse reads: the fields of :class:`Settings` (nothing else reads
    ``app.conf`` for a ``pulse_*`` key), so the list cannot drift from the code."""
    return frozenset(f"pulse_{field.name}" for field in dataclasses.fields(Settings))


def _spelled(name: str, prefix: str) -> str:
    """``name`` as Celery looks it up under the namespace ``prefix`` (its ``match_case``)."""
    if not prefix:
        return name
    key = prefix + name
    return key.upper() if prefix.isupper() else key.lower()


def _pulse_keys(conf: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(key as written, pulse name it aims at, prefix it used)`` for every key of
    ``conf`` in pulse's namespace: ``pulse_*`` and, under Celery's ``namespace=``
    (``conf.prefix``, e.g. ``CELERY_``), ``CELERY_PULSE_*``. Without a namespace an
    upper-case ``PULSE_*`` counts too (Celery never reads it: a silent mistake)."""
    keys = list(conf.keys())  # first: a pending Celery conf loads (and learns its prefix)
    prefix = str(getattr(conf, "prefix", None) or "")
    for key in keys:
        if not isinstance(key, str):
            continue
        lowered = key.lower()
        if prefix and lowered.startswith(prefix.lower() + "pulse_"):
            yield key, lowered[len(prefix):], prefix
        elif key.startswith("pulse_") or (not prefix and lowered.startswith("pulse_")):
            yield key, lowered, ""


def refuse_unknown(conf: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidConfig` naming every ``pulse_*`` key of ``conf`` that pulse
    would not read, each with the closest known setting (``pulse_lease_tll``: "did you
    mean pulse_lease_ttl?"), spelled the way the user's namespace needs it."""
    known = known_settings()
    problems: list[tuple[str, str]] = []
    for key, name, prefix in _pulse_keys(conf):
        if key == _spelled(name, prefix) and name in known:
            continue
        if name in known:  # a known setting in a case Celery does not look up
            problems.append((key, f"{key} is never read (write {_spelled(name, prefix)})"))
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = (f"did you mean {_spelled(close[0], prefix)}?" if close
                else "see docs/configuration.md for the settings pulse knows")
        problems.append((key, f"unknown setting {key} ({hint})"))
    if problems:
        raise InvalidConfig("; ".join(text for _key, text in problems),
                            setting=problems[0][0])


def refuse_unknown_task_options(tasks: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidConfig` for a registered task with a ``pulse_*`` option pulse
    does not know (``@app.task(pulse_max_atempts=3)`` would otherwise do nothing)."""
    for name, task in tasks.items():
        for option in sorted(attr for attr in dir(task) if attr.startswith("pulse_")):
            if option not in TASK_OPTIONS:
                close = difflib.get_close_matches(option, TASK_OPTIONS, n=1)
                hint = (f"did you mean {close[0]}?" if close
                        else f"pulse knows {', '.join(sorted(TASK_OPTIONS))}")
                raise InvalidConfig(f"task {name}: unknown option {option} ({hint})",
                                    setting=option)
