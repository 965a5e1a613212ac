"""The review queue: tasks whose outcome nobody knows, why each is there, and what to do.

Each item says why it is in review (its holder lost its lease after it started, its
budget ran out, its completion said so) and offers **Retry** (run it once more),
**Resolve succeeded** and **Resolve failed**, on one item or on every item matching the
filter. Actions go through :mod:`celery_pulse.operator`, as ``celery pulse review`` does:
the store decides, the message is re-published, Flower gets the task events. Each action
names the epoch the operator saw: a claim that moved on since (retried or resolved by
someone else) is refused and left as it is — a 409 in the API, a message on the page.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tornado import web

from celery_pulse.errors import Moved, NotFound
from celery_pulse.flower.base import MAX_LIMIT, ApiHandler, PageHandler, flash
from celery_pulse.operator import OUTCOMES, Decision, resolve_review, retry_review
from celery_pulse.store.pages import ClaimQuery
from celery_pulse.store.records import NEEDS_REVIEW
from celery_pulse.store.sql import SqlStore

#: What a page's button or an API call may ask: retry, or resolve with an outcome.
ACTIONS = ("retry", *OUTCOMES)


def review_payload(store: SqlStore, query: ClaimQuery) -> dict[str, Any]:
    """The items in review matching the filter, oldest first, each with its reason, and
    how many match in all (an "all matching" action takes them all, not just this page)."""
    items = store.list_review(limit=query.limit, query=query)
    total = store.find_claims(dataclasses.replace(query, limit=1, after=None)).total
    return {"now": store.now(), "total": total, "items": [dataclasses.asdict(i) for i in items]}


def act(capp: Any, store: SqlStore, action: str, task_ids: list[tuple[str, int | None]],
        who: str, note: str | None) -> dict[str, Any]:
    """``action`` on each ``(task_id, expected_epoch)``: what was done, what had moved on."""
    done: list[dict[str, Any]] = []
    moved: list[dict[str, str]] = []
    for task_id, epoch in task_ids:
        try:
            decision: Decision
            if action == "retry":
                decision = retry_review(capp, store, task_id, who=who, note=note,
                                        expected_epoch=epoch)
            else:
                decision = resolve_review(capp, store, task_id, action, who=who, note=note,
                                          expected_epoch=epoch)
        except NotFound as exc:  # Moved is a NotFound: it is there, but not as it was
            moved.append({"task_id": task_id, "error": str(exc),
                          "moved": "yes" if isinstance(exc, Moved) else "missing"})
            continue
        done.append(dataclasses.asdict(decision))
    return {"action": action, "done": done, "moved": moved}


#: Most items one "all matching" action takes (the oldest first; press again for more).
MAX_BULK = 10_000


def matching(store: SqlStore, query: ClaimQuery) -> list[tuple[str, int | None]]:
    """Every item in review matching ``query`` (up to :data:`MAX_BULK`), at its epoch now."""
    return [(i.task_id, i.epoch) for i in store.list_review(limit=MAX_BULK, query=query)]


class ReviewRequest:
    """What an action request names: one task (with the epoch seen) or all matching."""

    def __init__(self, handler: PageHandler | ApiHandler, body: dict[str, Any]) -> None:
        self.handler = handler
        self.body = body

    def value(self, name: str) -> str | None:
        if name in self.body:
            value = self.body[name]
            return None if value is None or value == "" else str(value)
        return self.handler.arg(name)

    def targets(self, store: SqlStore) -> list[tuple[str, int | None]]:
        if self.value("all") in ("1", "true", "yes", "True"):
            return matching(store, self.query)
        task_id = self.value("task_id")
        if not task_id:
            raise web.HTTPError(400, "give task_id (and epoch, the epoch you saw) or all=1 "
                                     "with the filter (queue, task, worker)")
        epoch = self.value("epoch")
        try:
            return [(task_id, None if epoch is None else int(epoch))]
        except ValueError:
            raise web.HTTPError(400, f"epoch must be an integer, got {epoch!r}") from None

    @property
    def query(self) -> ClaimQuery:
        return ClaimQuery(states=(NEEDS_REVIEW,), queue=self.value("queue"),
                          task_name=self.value("task"), worker=self.value("worker"),
                          limit=MAX_LIMIT)


def run(store: SqlStore, capp: Any, request: ReviewRequest, action: str, who: str
        ) -> dict[str, Any]:
    """The action on its targets (``PulseContext``'s call passes the store first)."""
    targets = request.targets(store)  # an HTTPError (400) for a request naming nothing
    result = act(capp, store, action, targets, who, request.value("note"))
    result["matched"] = len(targets)
    return result


class ReviewPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        query = self.claim_query(states=(NEEDS_REVIEW,))
        data = await self.call(review_payload, query)
        self.render_page("pulse_review.html", active="review", query=query, **data)


class ReviewAction(PageHandler):
    """The page's buttons: a form POST, then back to the page with what happened."""

    @web.authenticated
    async def post(self) -> None:
        action = self.arg("action")
        if action not in ACTIONS:
            raise web.HTTPError(400, f"unknown action {action!r}; valid: {', '.join(ACTIONS)}")
        result = await self.call(run, self.capp, ReviewRequest(self, {}), action, self.who())
        self.redirect(self.reverse_url("pulse-review") + "?" + flash(*summary(result)), 303)


def summary(result: dict[str, Any]) -> tuple[str, str]:
    """What the page says after an action, and how loud."""
    verb = "retried" if result["action"] == "retry" else f"resolved {result['action']}"
    parts = []
    if result["done"]:
        parts.append(f"{verb}: " + ", ".join(d["task_id"] for d in result["done"]))
    parts += [m["error"] for m in result["moved"]]  # the store's message: "...: nothing was changed"
    if not parts:
        parts.append("nothing matched: nothing changed")
    return "; ".join(parts), "warning" if result["moved"] or not result["done"] else "success"


class ReviewApi(ApiHandler):
    """``GET /api/pulse/review?queue=..&task=..&worker=..&limit=..``."""

    @web.authenticated
    async def get(self) -> None:
        self.write(await self.call(review_payload, self.claim_query(states=(NEEDS_REVIEW,))))


class ReviewActionApi(ApiHandler):
    """``POST /api/pulse/review/retry`` and ``/api/pulse/review/resolve`` (``outcome=``).

    Form fields, query arguments or a JSON object: ``task_id`` and ``epoch`` (the epoch
    seen: a claim at another is refused), or ``all=1`` with ``queue``/``task``/``worker``;
    ``note``. One task that moved on is a 409; with ``all``, the moved ones are listed.
    """

    @web.authenticated
    async def post(self, verb: str) -> None:
        body = self.json_body()
        request = ReviewRequest(self, body)
        action = "retry" if verb == "retry" else request.value("outcome")
        if action not in ACTIONS or (verb == "resolve" and action == "retry"):
            raise web.HTTPError(400, f"unknown outcome {action!r}; valid outcomes: "
                                     f"{', '.join(OUTCOMES)}")
        result = await self.call(run, self.capp, request, action, self.who())
        if request.value("all") is None and result["moved"]:
            self.set_status(409 if result["moved"][0]["moved"] == "yes" else 404)
            self.finish({"error": result["moved"][0]["error"], "status": self.get_status(),
                         **result})
            return
        self.write(result)

    def json_body(self) -> dict[str, Any]:
        if not self.request.headers.get("Content-Type", "").startswith("application/json"):
            return {}
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise web.HTTPError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "the body must be a JSON object")
        return body
