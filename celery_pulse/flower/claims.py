"""The claims pages: every claim, filtered and paginated, and one claim in detail.

The list reads ``find_claims`` (newest first, a keyset cursor: a deep page costs what the
first does) and the detail ``claim_detail`` (the claim, its evidence rows — late answers of
stale attempts, kept and never applied — and its review audit). "Lease remaining" is the
store's ``lease_until - now``, not Flower's clock.
"""

from __future__ import annotations

from typing import Any

from tornado import web

from celery_pulse.flower.base import ApiHandler, PageHandler
from celery_pulse.store.pages import ClaimQuery
from celery_pulse.store.records import CLAIM_STATES
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.views import claim_row, detail_row


def claims_payload(store: SqlStore, query: ClaimQuery) -> dict[str, Any]:
    """One page of claims matching ``query``, with the cursor of the next and the total."""
    page = store.find_claims(query)
    return {"now": page.now, "total": page.total, "next": page.next,
            "claims": [claim_row(c) for c in page.rows],
            "filter": {"state": list(query.states), "queue": query.queue,
                       "task": query.task_name, "worker": query.worker, "limit": query.limit,
                       "after": query.after}}


def claim_payload(store: SqlStore, task_id: str) -> dict[str, Any]:
    """One claim, its evidence rows and its review audit; a missing claim is a 404."""
    detail = store.claim_detail(task_id)
    if detail is None:
        raise web.HTTPError(404, f"no claim for task {task_id!r}")
    return {"now": store.now(), **detail_row(detail)}


class ClaimsPage(PageHandler):
    @web.authenticated
    async def get(self) -> None:
        query = self.claim_query()
        data = await self.call(claims_payload, query)
        self.render_page("pulse_claims.html", active="claims", states=CLAIM_STATES,
                         query=query, **data)


class ClaimsApi(ApiHandler):
    """``GET /api/pulse/claims?state=..&queue=..&task=..&worker=..&limit=50&after=..``."""

    @web.authenticated
    async def get(self) -> None:
        self.write(await self.call(claims_payload, self.claim_query()))


class ClaimPage(PageHandler):
    @web.authenticated
    async def get(self, task_id: str) -> None:
        self.known_params()
        data = await self.call(claim_payload, task_id)
        self.render_page("pulse_claim.html", active="claims", **data)


class ClaimApi(ApiHandler):
    @web.authenticated
    async def get(self, task_id: str) -> None:
        self.known_params()
        self.write(await self.call(claim_payload, task_id))
