"""Django admin pages over pulse: claims, the review queue (retry, resolve), workers, the
beat's leader and schedule, and concurrency limits.

Read-only views of the store's rows (:mod:`.models`, queried on the pulse database: the
Celery app's ``pulse_database``); the review queue's actions are the operator's own
(:mod:`celery_pulse.operator`: the store's decision, fenced by the epoch the page
showed, then Flower's events and, for a retry, the re-publish), as ``celery pulse
review`` and the Pulse page in Flower do them. Django's permissions decide: ``view`` to
see a page, ``change`` on "task in review" to act.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

from django.contrib import admin, messages

from celery_pulse.contrib.django.models import (
    Claim,
    Leader,
    Permit,
    ReviewItem,
    ScheduleEntry,
    Worker,
)
from celery_pulse.errors import NotFound, PulseError

_store_lock = threading.Lock()
_store: Any = None
#: The store's clock as read for the page being drawn (per thread: a server may draw
#: several pages at once).
_page = threading.local()


def _app_and_settings() -> tuple[Any, Any]:
    from celery import current_app

    from celery_pulse.settings import Settings

    app = current_app._get_current_object()
    return app, Settings.from_conf(app.conf)


def pulse_store() -> Any:
    """This process's store (opened once): the Celery app's."""
    global _store
    with _store_lock:
        if _store is None:
            from celery_pulse.store.sql import open_store

            _store = open_store(_app_and_settings()[1].store_url)
        return _store


def _now(default: float) -> float:
    """The store's clock read for this page (``default`` outside a list page)."""
    return float(getattr(_page, "now", default))


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class PulseAdmin(admin.ModelAdmin):
    """Read-only, on the pulse database: nothing is added, changed or deleted here."""

    def get_queryset(self, request: Any) -> Any:
        alias = _app_and_settings()[1].database or "default"
        return super().get_queryset(request).using(alias)

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: Any, extra_context: Any = None) -> Any:
        _page.now = pulse_store().now()  # the store's clock, once per page
        return super().changelist_view(request, extra_context)

    def get_readonly_fields(self, request: Any, obj: Any = None) -> Any:
        return [f.name for f in self.model._meta.fields]


@admin.register(Claim)
class ClaimAdmin(PulseAdmin):
    list_display: tuple[str, ...] = ("task_id", "task_name", "state", "queue", "holder", "epoch",
                    "lease_remaining", "attempts", "created")
    list_filter: tuple[str, ...] = ("state", "queue", "task_name", "holder")
    search_fields = ("task_id", "task_name", "holder")
    show_full_result_count = False

    @admin.display(description="lease remaining")
    def lease_remaining(self, claim: Claim) -> str:
        if claim.lease_until is None or claim.state not in ("reserved", "running"):
            return "—"
        return f"{claim.lease_until - _now(claim.lease_until):.1f} s"

    @admin.display(description="created", ordering="created_at")
    def created(self, claim: Claim) -> str:
        return _when(claim.created_at)


@admin.register(ReviewItem)
class ReviewAdmin(ClaimAdmin):
    list_display: tuple[str, ...] = ("task_id", "task_name", "queue", "holder", "epoch", "attempts", "error",
                    "finished")
    list_filter: tuple[str, ...] = ("queue", "task_name")
    actions = ("retry", "resolve_succeeded", "resolve_failed")

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).filter(state="needs_review")

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        # The actions need it; no claim is ever edited in a form.
        return obj is None and admin.ModelAdmin.has_change_permission(self, request)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, claim: Claim) -> str:
        return _when(claim.finished_at)

    @admin.action(description="Retry the selected tasks once more", permissions=["change"])
    def retry(self, request: Any, queryset: Any) -> None:
        from celery_pulse.operator import retry_review

        self._decide(request, queryset, "retried", lambda app, store, item, who: retry_review(
            app, store, item.task_id, who=who, note="Django admin", expected_epoch=item.epoch))

    @admin.action(description="Resolve the selected tasks as succeeded", permissions=["change"])
    def resolve_succeeded(self, request: Any, queryset: Any) -> None:
        self._resolve(request, queryset, "succeeded")

    @admin.action(description="Resolve the selected tasks as failed", permissions=["change"])
    def resolve_failed(self, request: Any, queryset: Any) -> None:
        self._resolve(request, queryset, "failed")

    def _resolve(self, request: Any, queryset: Any, outcome: str) -> None:
        from celery_pulse.operator import resolve_review

        self._decide(request, queryset, f"resolved {outcome}",
                     lambda app, store, item, who: resolve_review(
                         app, store, item.task_id, outcome, who=who, note="Django admin",
                         expected_epoch=item.epoch))

    def _decide(self, request: Any, queryset: Any, done: str, act: Any) -> None:
        """Each selected task by itself: one that moved on since the page was drawn is
        reported and left as it is."""
        app, store, who = _app_and_settings()[0], pulse_store(), request.user.get_username()
        decided = 0
        for item in queryset:
            try:
                act(app, store, item, who)
                decided += 1
            except NotFound as exc:
                self.message_user(request, f"{item.task_id}: {exc}", messages.WARNING)
            except PulseError as exc:
                self.message_user(request, f"{item.task_id}: {exc}", messages.ERROR)
        if decided:
            self.message_user(request, f"{decided} task(s) {done}.", messages.SUCCESS)


@admin.register(Worker)
class WorkerAdmin(PulseAdmin):
    list_display: tuple[str, ...] = ("worker_id", "alive", "draining", "heartbeat", "registered")
    list_filter: tuple[str, ...] = ("draining",)
    search_fields = ("worker_id",)

    @admin.display(boolean=True, description="alive")
    def alive(self, worker: Worker) -> bool:
        return worker.expires_at > _now(worker.expires_at)

    @admin.display(description="last heartbeat", ordering="last_heartbeat")
    def heartbeat(self, worker: Worker) -> str:
        return _when(worker.last_heartbeat)

    @admin.display(description="registered", ordering="registered_at")
    def registered(self, worker: Worker) -> str:
        return _when(worker.registered_at)


@admin.register(Leader)
class LeaderAdmin(PulseAdmin):
    list_display: tuple[str, ...] = ("key", "holder", "epoch", "lease_remaining", "since")

    @admin.display(description="lease remaining")
    def lease_remaining(self, leader: Leader) -> str:
        return f"{leader.lease_until - _now(leader.lease_until):.1f} s"

    @admin.display(description="since", ordering="acquired_at")
    def since(self, leader: Leader) -> str:
        return _when(leader.acquired_at)


@admin.register(ScheduleEntry)
class ScheduleAdmin(PulseAdmin):
    list_display: tuple[str, ...] = ("name", "task", "kind", "spec", "enabled", "updated")
    list_filter: tuple[str, ...] = ("enabled", "kind")
    search_fields = ("name", "task")

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, entry: ScheduleEntry) -> str:
        return _when(entry.updated_at)


@admin.register(Permit)
class PermitAdmin(PulseAdmin):
    list_display: tuple[str, ...] = ("key", "max_running", "updated")

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, permit: Permit) -> str:
        return _when(permit.updated_at)
