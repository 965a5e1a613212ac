"""What every claim engine shares: the claim contract's rules in SQL terms, and the
helpers that batch claims into statements.

The rules themselves are written once, SQL-free, in :mod:`celery_pulse.store.rules`
(the memory store decides by them too); here they meet claim rows. The *claimable*
rule (which claim a reservation may take) is :data:`~celery_pulse.store.rules.CLAIMABLE`,
and both forms the engines need come from it: :func:`claimable_sql` for the
one-statement reservation (PostgreSQL, SQLite) and :func:`claimable` for a decision on a
row read under lock (MySQL) or for the reason of a refusal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.store import rules
from celery_pulse.store.base import (
    FAILED,
    LIVE_STATES,
    RUNNING,
    Completion,
    Grant,
    LeaseKey,
    Message,
    Recovered,
    ReserveRequest,
)
from celery_pulse.store.rules import ANSWER_RANK, CLAIMABLE, OUTCOME_STATE
from celery_pulse.store.sql.tables import claims, evidence

#: Renewals and completions are chunked so one statement never carries huge IN lists.
CHUNK = 500
#: The live states as an SQL list, for the hot path's hand-written statements.
LIVE_SQL = ", ".join(f"'{state}'" for state in LIVE_STATES)


def usual(completions: Sequence[Completion], reserves: Sequence[ReserveRequest],
          starts: Sequence[LeaseKey]) -> bool:
    """Whether an exchange is a usual one, that a store can make in one pass of one
    statement per verb: not empty, each verb in one chunk, no ``pulse://`` result (it is
    written beside its completion), no task id twice in a verb (no rounds)."""
    if not 0 < max(len(completions), len(reserves), len(starts)) <= CHUNK:
        return False
    if any(c.result is not None for c in completions):
        return False
    return (len({c.task_id for c in completions}) == len(completions)
            and len({r.task_id for r in reserves}) == len(reserves))


def applies(c: Completion, epoch: Any, token: str | None, state: str) -> bool:
    """Whether ``c`` is applied to its claim as read under lock: live under its lease."""
    return int(epoch) == c.epoch and token == c.token and state in LIVE_STATES


def repeats(c: Completion, epoch: Any, state: str) -> bool:
    """Whether a completion that did not apply is ``duplicate``: its claim already holds
    its outcome under its epoch (else it is ``evidence``)."""
    return int(epoch) == c.epoch and state == OUTCOME_STATE[c.outcome]


def claimable(row: Any) -> bool:
    """:data:`CLAIMABLE` for a row with ``state``, ``policy`` and ``expired`` (the store
    clock's verdict, ``lease_until <= now``; NULL when the claim has no lease)."""
    return rules.claimable(row.state, row.policy, bool(row.expired))


def claimable_sql(expired: str) -> str:
    """:data:`CLAIMABLE` as SQL on ``pulse_claims``; ``expired`` is the expiry test."""
    terms = []
    for state, expires, policy in CLAIMABLE:
        term = [f"pulse_claims.state = '{state}'"]
        if policy is not None:
            term.append(f"pulse_claims.policy = '{policy}'")
        if expires:
            term.append(expired)
        terms.append(term[0] if len(term) == 1 else f"({' AND '.join(term)})")
    return " OR ".join(terms)


def grants(rows: Any) -> dict[str, Grant]:
    """The reservation statement's rows (task_id, epoch, token, lease_until, attempts,
    state) as grants."""
    return {task_id: Grant(task_id, int(epoch), token, float(lease_until), int(attempts),
                           state == RUNNING)
            for task_id, epoch, token, lease_until, attempts, state in rows}


def started_leases(rows: Any) -> dict[str, float]:
    """The start statement's rows (task_id, lease_until): ``task_id -> lease_until``."""
    return {task_id: float(lease_until) for task_id, lease_until in rows}


def task_id_of(item: Any) -> str:
    """The sort key that gives concurrent batches one lock order."""
    return str(item.task_id)


def best(out: dict[str, str], answers: dict[str, str]) -> None:
    """Merge ``answers`` into ``out``, keeping for each task id the best by
    :data:`~celery_pulse.store.rules.ANSWER_RANK`."""
    for task_id, answer in answers.items():
        if ANSWER_RANK[answer] > ANSWER_RANK.get(out.get(task_id, ""), -1):
            out[task_id] = answer


#: Built once: ``json.dumps`` with options builds an encoder per call (three per reservation).
_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


def dumps(value: Any) -> str:
    """A message's headers, properties or delivery info as the claim row keeps them."""
    return _ENCODER.encode(dict(value))


def lease_key_in(leases: Sequence[LeaseKey]) -> Any:
    """The claim rows whose (task_id, epoch, token) is one of ``leases``."""
    return sa.tuple_(claims.c.task_id, claims.c.epoch, claims.c.token).in_(
        [tuple(lease) for lease in leases])


def exhaust(conn: sa.Connection, now: Any, row: Any, *states: str) -> None:
    """Fail a claim whose attempt budget is spent (``row`` was read with its epoch;
    ``states``: the state it must still be in, if any)."""
    conn.execute(sa.update(claims).where(
        claims.c.task_id == row.task_id, claims.c.epoch == row.epoch,
        *(claims.c.state == state for state in states)).values(
        state=FAILED, outcome="exhausted", finished_at=now, lease_until=None,
        token=None, error=f"attempt budget exhausted ({row.attempts} of "
                          f"{row.max_attempts} reservations used)"))


def stale_answers(conn: sa.Connection, holder: str, stale: list[Completion], now: Any
                  ) -> dict[str, str]:
    """Completions that applied to nothing: ``duplicate`` when the claim already holds
    that outcome under the same epoch, else ``evidence`` (recorded in ``pulse_evidence``)."""
    current = {r.task_id: r for r in conn.execute(
        sa.select(claims.c.task_id, claims.c.state, claims.c.epoch)
        .where(claims.c.task_id.in_([c.task_id for c in stale])))}
    out: dict[str, str] = {}
    evidence_rows = []
    for c in stale:
        row = current.get(c.task_id)
        if row is not None and repeats(c, row.epoch, row.state):
            out[c.task_id] = "duplicate"
            continue
        out[c.task_id] = "evidence"
        evidence_rows.append(dict(task_id=c.task_id, epoch=c.epoch, holder=holder,
                                  outcome=c.outcome, error=c.error, recorded_at=now,
                                  result=c.returned))
    if evidence_rows:
        conn.execute(sa.insert(evidence).values(evidence_rows))
    return out


def recovered(row: Any, state: str, epoch: int, token: str | None) -> Recovered:
    """A claim row (as read before the move) taken back to ``state``: its message, for
    publishing it again, and its holder until then."""
    return Recovered(row.task_id, row.task_name, state, row.state, epoch, token,
                     int(row.attempts), Message(
                         bytes(row.body), json.loads(row.headers), json.loads(row.properties),
                         json.loads(row.delivery_info), row.content_type,
                         row.content_encoding), row.holder)
