"""Example tasks, one per kind of guarantee you may need.

* :func:`charge` — a payment. It must never run twice, so it is *not* ``acks_late``:
  if its worker dies mid-call, pulse sends it to the review queue instead of running
  it again. Its ledger row is written inside ``lease.fenced(conn)``: it commits only
  while this attempt still holds the lease, judged by the store's clock.
* :func:`build_report` — a long job that is safe to restart (``acks_late=True``): a
  lost attempt is re-dispatched. It checks its lease between sections and writes its
  result under the lease, so a paused, stale copy can't overwrite the new one.
* :func:`sync_rates` — idempotent (``pulse_idempotent=True``), run by the
  leader-elected beat every few seconds; a re-run just upserts the same rows.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import sqlalchemy as sa
from celery.utils.log import get_task_logger
from sqlalchemy.dialects import postgresql, sqlite

from celery_pulse import Lease, LeaseLost, current_lease
from example_project.app import app
from example_project.schema import engine_for, ledger, rates, reports

logger = get_task_logger(__name__)


def db() -> sa.Engine:
    """An engine on the pulse store's database (one per pool process)."""
    return engine_for(app.conf.pulse_store_url)


def require_lease() -> Lease:
    lease = current_lease()
    if lease is None:  # eager mode, or a worker without -P pulse
        raise RuntimeError("this task must run on a `celery worker -P pulse`")
    return lease


def call_payment_provider(order_id: str, amount_cents: int, seconds: float) -> str:
    """Stand-in for an HTTP call to a payment provider (blocking, slow, not undoable).

    A real call would pass ``order_id`` as the provider's idempotency key, so a human
    who retries a reviewed payment can't charge the card twice.
    """
    time.sleep(seconds)
    return "ch_" + hashlib.sha1(f"{order_id}:{amount_cents}".encode()).hexdigest()[:12]


@app.task(bind=True, acks_late=False, name="example_project.tasks.charge")
def charge(self: Any, order_id: str, amount_cents: int, provider_seconds: float = 1.0
           ) -> dict[str, Any]:
    """Charge an order once. Lost mid-call -> ``needs_review``, never re-run by itself."""
    lease = require_lease()
    with db().connect() as conn:
        done = conn.execute(sa.select(ledger.c.provider_ref)
                            .where(ledger.c.order_id == order_id)).scalar_one_or_none()
    if done is not None:  # e.g. a reviewer retried a payment that had gone through
        logger.info("charge %s: already in the ledger (%s), nothing to do", order_id, done)
        return {"order_id": order_id, "provider_ref": done, "already": True}

    lease.check()  # still ours? (cheap, local: the deadline and the revoked flag)
    logger.info("charge %s: calling the payment provider (epoch %d)", order_id, lease.epoch)
    ref = call_payment_provider(order_id, amount_cents, provider_seconds)

    # Record the charge only while we still hold the lease. If another attempt took
    # over meanwhile, this rolls back and raises LeaseLost: no row from a stale holder.
    with db().connect() as conn, lease.fenced(conn):
        conn.execute(sa.insert(ledger).values(
            order_id=order_id, amount_cents=amount_cents, provider_ref=ref,
            task_id=lease.task_id, epoch=lease.epoch, worker=self.request.hostname))
    logger.info("charge %s: ledger row written under epoch %d", order_id, lease.epoch)
    return {"order_id": order_id, "provider_ref": ref, "epoch": lease.epoch}


@app.task(bind=True, acks_late=True, name="example_project.tasks.build_report")
def build_report(self: Any, name: str, sections: int = 10, seconds_per_section: float = 1.0
                 ) -> dict[str, Any]:
    """A long report. Lost -> re-dispatched (acks_late), then started again from scratch."""
    lease = require_lease()
    logger.info("report %s: starting on %s (epoch %d)", name, self.request.hostname,
                lease.epoch)
    done = 0
    try:
        for _ in range(sections):
            lease.check()  # stop at the first section boundary after a loss
            time.sleep(seconds_per_section)  # ... crunch numbers ...
            done += 1
        with db().connect() as conn, lease.fenced(conn):
            conn.execute(sa.delete(reports).where(reports.c.name == name))
            conn.execute(sa.insert(reports).values(
                name=name, sections=done, task_id=lease.task_id, epoch=lease.epoch,
                worker=self.request.hostname))
    except LeaseLost:
        logger.warning("report %s: lease lost after %d/%d sections (epoch %d): stopping, "
                       "nothing written", name, done, sections, lease.epoch)
        raise
    logger.info("report %s: written under epoch %d", name, lease.epoch)
    return {"name": name, "sections": done, "epoch": lease.epoch}


CURRENCIES = ("EUR", "GBP", "JPY", "CHF")


@app.task(bind=True, pulse_idempotent=True, name="example_project.tasks.sync_rates")
def sync_rates(self: Any) -> int:
    """Pull exchange rates and upsert them. Idempotent: safe to run again after a loss."""
    lease = current_lease()
    if lease is not None:
        lease.check()
    fetched = {c: round(random.uniform(0.5, 150.0), 4) for c in CURRENCIES}
    engine = db()
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    with engine.begin() as conn:
        for currency, rate in fetched.items():
            stmt = insert(rates).values(currency=currency, rate=rate,
                                        synced_by=self.request.hostname, syncs=1)
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[rates.c.currency],
                set_={"rate": stmt.excluded.rate, "synced_by": stmt.excluded.synced_by,
                      "syncs": rates.c.syncs + 1}))
    return len(fetched)
