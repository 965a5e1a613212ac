"""The cluster pages: workers by the store's clock (with Drain), the leader and beat, permits.

Each page has its JSON twin under ``/api/pulse/...``; both read the same payload function,
so what the page shows is what the API answers. Times are the store's clock: a worker is
alive while its registration is unexpired by the store's ``now``, whatever Flower's events
say (a SIGSTOPped worker is offline for Flower and alive here until its TTL runs out).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tornado import web

from celery_pulse.errors import NotFound
from celery_pulse.flower.base import ApiHandler, PageHandler, flash
from celery_pulse.store.sql import SqlStore

logger = logging.getLogger("celery_pulse.flower")


def workers_payload(store: SqlStore) -> dict[str, Any]:
    """Registered workers with their state by the store's clock."""
    rows = []
    for w in store.list_workers():
        state = "draining" if w.draining and w.alive else "alive" if w.alive else "expired"
        rows.append({"id": w.worker_id, "state": state, "alive": w.alive,
                     "draining": w.draining, "expires_in": round(w.expires_in, 3),
                     "via": "gateway" if w.labels.get("via") == "gateway" else "direct",
                     "labels": dict(w.labels), "registered_at": w.registered_at,
                     "last_heartbeat": w.last_heartbeat})
    return {"now": store.now(), "workers": rows}


def set_drain(store: SqlStore, worker: str, draining: bool, who: str) -> dict[str, Any]:
    """Drain (or undrain) ``worker``; a name the registry never had is a 404."""
    if worker not in {w.worker_id for w in store.list_workers()}:
        raise NotFound(f"no registered worker {worker!r}")
    store.set_drain(worker, draining, who)
    action = "drain" if draining else "undrain"
    logger.info("pulse: %s of %s by %s", action, worker, who)
    said = "drain requested (seen at its next heartbeat)" if draining else "drain cleared"
    return {"worker": worker, "draining": draining, "message": f"{worker}: {said}"}


def leader_payload(store: SqlStore, capp: Any) -> dict[str, Any]:
    """The beat leader's lease, and each schedule entry's last and next slot."""
    from celery_pulse.worker.schedules import dynamic_entries, static_entries
    from celery_pulse.worker.service import BEAT_KEY

    info = store.get_leader(BEAT_KEY)
    leader = None if info is None else {
        "holder": info.holder, "epoch": info.epoch, "alive": info.alive,
        "lease_remaining": round(info.lease_remaining, 3), "acquired_at": info.acquired_at}
    last = store.last_run()
    rows = store.list_schedule()
    static = static_entries(capp)
    names = {e.name for e in static}
    dynamic = {e.name: e for e in dynamic_entries(rows) if e.name not in names}
    entries = [_entry(e, "static", True, last.get(e.name)) for e in static]
    for row in rows:
        if row.name in names:
            continue
        entry = dynamic.get(row.name)
        entries.append(_entry(entry, "dynamic", row.enabled, last.get(row.name),
                              name=row.name, task=row.task))
    return {"now": store.now(), "leader": leader, "entries": entries}


def _entry(entry: Any, source: str, enabled: bool, last: float | None, *,
           name: str | None = None, task: str | None = None) -> dict[str, Any]:
    nxt = None
    if entry is not None and enabled and last is not None:
        nxt = entry.next_due(last)
    return {"name": name or entry.name, "task": task or entry.task, "source": source,
            "enabled": enabled, "last_slot": last, "next_slot": nxt}


def permits_payload(store: SqlStore) -> dict[str, Any]:
    """Each concurrency key: its limit, held, waiting, and since when the oldest waits."""
    now = store.now()
    rows = []
    for u in store.permit_usage():
        row = dataclasses.asdict(u)
        since = row.get("oldest_waiting_since")
        row["held"] = u.running
        row["oldest_waiting_for"] = None if since is None else round(now - since, 3)
        rows.append(row)
    return {"now": now, "permits": rows}


class WorkersPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        self.known_params()
        data = await self.call(workers_payload)
        self.render_page("pulse_workers.html", active="workers", **data)


class DrainAction(PageHandler):
    """The page's Drain/Undrain buttons: a form POST, then back to the page with a message."""

    @web.authenticated
    async def post(self) -> None:
        worker, action = self.arg("worker"), self.arg("action")
        if not worker or action not in ("drain", "undrain"):
            raise web.HTTPError(400, "give worker and action=drain|undrain")
        try:
            done = await self.call(set_drain, worker, action == "drain", self.who())
            message, level = done["message"], "success"
        except web.HTTPError as exc:
            message, level = exc.log_message or str(exc), "warning"
        self.redirect(self.reverse_url("pulse-workers") + "?" + flash(message, level), 303)


class WorkersApi(ApiHandler):
    @web.authenticated
    async def get(self) -> None:
        self.known_params()
        self.write(await self.call(workers_payload))


class DrainApi(ApiHandler):
    @web.authenticated
    async def post(self, action: str, worker: str) -> None:
        self.write(await self.call(set_drain, worker, action == "drain", self.who()))


class LeaderPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        self.known_params()
        data = await self.call(leader_payload, self.capp)
        self.render_page("pulse_leader.html", active="leader", **data)


class LeaderApi(ApiHandler):
    @web.authenticated
    async def get(self) -> None:
        self.known_params()
        self.write(await self.call(leader_payload, self.capp))


class PermitsPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        self.known_params()
        self.render_page("pulse_permits.html", active="permits",
                         **await self.call(permits_payload))


class PermitsApi(ApiHandler):
    @web.authenticated
    async def get(self) -> None:
        self.known_params()
        self.write(await self.call(permits_payload))
