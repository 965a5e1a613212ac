"""PostgreSQL's starts under permits, on the worker's pipelined connection: plain SQL
(arrays for every batch size, prepared once), no SQLAlchemy.

One batch is one transaction in two round trips (:class:`PermitPlan`): lock the keys,
tidy and count their holders and past starts, read which leases are still live
reservations; then, decided in Python from those rows, start and record. On the worker's
event loop the first half goes out with the rest of the exchange
(:class:`~.pipeline_tx.TwoTrips`); alone, :func:`start_pipelined`. Each statement reads
a fresh snapshot (READ COMMITTED), so the count that follows a key's lock sees every
start that held the lock before it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from celery_pulse.store.base import RESERVED, RUNNING, LeaseKey, Permit, Waiting
from celery_pulse.store.rules import rate_grants, rate_wants, rate_windows
from celery_pulse.store.sql import rates
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.permits import decide, waiting_of, wanted_of
from celery_pulse.store.sql.pipeline import Pipeline
from celery_pulse.store.sql.pipeline_tx import Rows, Statement, TwoTrips

#: A batch's statements here each find a few rows by key. On tables the planner has no
#: statistics for yet (a new store: autovacuum analyzes it within a minute or so), it
#: plans sequential scans of ``pulse_claims``, and the generic plan of a prepared
#: statement keeps them for good (measured: 0.2-0.8 ms a statement at 2,000 claims, 4-10
#: times the index's). Sequential scans are put last for the rest of the transaction.
INDEXES_ONLY = "SET LOCAL enable_seqscan = off"
#: The same, and the rest of the transaction on generic plans, for a batch of rate keys
#: alone. PostgreSQL kept planning each of its statements anew (a custom plan: their
#: array parameters make the generic plan's estimate look worse), and the planning cost
#: more than the running: measured through the store, 3,000 rated starts in batches of
#: two, its CPU per start fell from 0.67 to 0.31 ms. A batch with concurrency keys keeps
#: custom plans: on generic ones their holders' statements cost more (measured the same
#: way, each start completed after: 0.72 -> 1.33 ms).
INDEXES_ONLY_GENERIC = ("SELECT set_config('enable_seqscan', 'off', true), "
                        "set_config('plan_cache_mode', 'force_generic_plan', true)")


@functools.lru_cache(maxsize=4)
def statements(now: str) -> dict[str, str]:
    """:func:`.permits.start`'s statements in plain PostgreSQL (arrays for every batch size),
    built once per clock expression, not at every start."""
    live = f"('{RESERVED}', '{RUNNING}')"
    return {
        "lock": (
            "INSERT INTO pulse_permits (key, max_running, updated_at, window_s) "
            f"SELECT k, l, {now}, w FROM unnest(%s::text[], %s::int[], %s::float8[]) "
            "AS t(k, l, w) ORDER BY k "
            "ON CONFLICT (key) DO UPDATE SET max_running = EXCLUDED.max_running, "
            # A rate key's moves with its buckets, after the batch (.rate_bound).
            "updated_at = CASE WHEN EXCLUDED.window_s IS NULL THEN EXCLUDED.updated_at "
            "ELSE pulse_permits.updated_at END, window_s = EXCLUDED.window_s "
            # Unchanged, a rate key's row is only locked (every conflicting row is), not
            # written: it is written once, with its buckets, after the batch.
            "WHERE EXCLUDED.window_s IS NULL OR pulse_permits.window_s IS DISTINCT FROM "
            "EXCLUDED.window_s OR pulse_permits.max_running <> EXCLUDED.max_running"),
        "drop_past": (
            "DELETE FROM pulse_permit_holds h WHERE h.key = ANY(%s::text[]) AND h.held "
            "AND NOT EXISTS "
            "(SELECT 1 FROM pulse_claims c WHERE c.task_id = h.task_id AND c.epoch = h.epoch "
            f"AND c.state IN {live})"),
        "holders": (
            "SELECT h.key, count(*) FROM pulse_permit_holds h JOIN pulse_claims c "
            "ON c.task_id = h.task_id AND c.epoch = h.epoch WHERE h.key = ANY(%s::text[]) "
            f"AND h.held AND c.state = '{RUNNING}' GROUP BY h.key"),
        # By primary key alone (whether each is a live reservation of the holder is
        # answered per row): an index on holder would match every claim the worker
        # ever held.
        "live": (
            f"SELECT task_id, epoch, token, holder = %s AND state = '{RESERVED}' "
            f"AND lease_until > {now} FROM pulse_claims WHERE task_id = ANY(%s::text[]) "
            "ORDER BY task_id FOR UPDATE"),
        "start": (
            f"UPDATE pulse_claims SET state = '{RUNNING}', started_at = {now}, "
            f"lease_until = {now} + %s WHERE task_id = ANY(%s::text[]) "
            "RETURNING task_id, lease_until"),
        # Under a rate, a start is at the time its batch was decided at (the time its
        # window counts it at), its lease from now.
        "start_at": (
            f"UPDATE pulse_claims SET state = '{RUNNING}', started_at = %s, "
            f"lease_until = {now} + %s WHERE task_id = ANY(%s::text[]) "
            "RETURNING task_id, lease_until"),
        "forget": "DELETE FROM pulse_permit_holds WHERE task_id = ANY(%s::text[])",
        "hold": (
            "INSERT INTO pulse_permit_holds (key, task_id, epoch, held) "
            "SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::bool[])"),
        "indexes_only": INDEXES_ONLY,
        "indexes_only_generic": INDEXES_ONLY_GENERIC,
        **rates.pg_sql(now),
    }


class PermitPlan:
    """One batch of limited starts as the two halves of its transaction: :attr:`first`
    (sent at once), :meth:`then` (from the first half's rows: the starts and holds, sent
    with the ``COMMIT``), :meth:`outcome` (from the second half's rows).

    ``folded``: task ids reserved earlier in the same transaction whose starts go with
    these (:attr:`~celery_pulse.store.base.ReserveRequest.permits`); their leases are
    known from the reservation's rows only, given to :meth:`then`. After the starts
    asked before them: those were reserved first."""

    def __init__(self, dialect: Dialect, holder: str, leases: Sequence[LeaseKey],
                 ttl: float, needs: Mapping[str, Sequence[Permit]],
                 folded: Sequence[str] = ()) -> None:
        self.sql = sql = statements(dialect.clock)
        self.leases, self.ttl, self.folded = list(leases), ttl, folded
        self.wanted, limits = wanted_of([*leases, *((t, 0, "") for t in folded)], needs)
        self.windows = windows = rate_windows(self.wanted)
        self.wants = rate_wants(self.wanted)
        keys = sorted(limits)
        held_keys = [k for k in keys if k not in windows]
        ordered = sorted({lease[0] for lease in leases} | set(folded))
        named: list[tuple[str, Sequence[Any]]] = [
            ("indexes_only_generic" if windows and not held_keys else "indexes_only", ()),
            ("lock", (keys, [limits[k] for k in keys], [windows.get(k) for k in keys])),
            ("live", (holder, ordered))]
        if held_keys:  # concurrency limits: who holds them
            named += [("drop_past", (held_keys,)), ("holders", (held_keys,))]
        if windows:  # rate limits: the starts in each window
            named += [("rate_drop", rates.pg_params(windows)),
                      ("rate_count", rates.pg_count_params(windows, self.wants))]
        #: Where each statement's rows are in the first half's.
        self.at = {name: i for i, (name, _) in enumerate(named)}
        self.first: list[Statement] = [(sql[name], params) for name, params in named]
        self.granted: list[LeaseKey] = []
        self.waiting: list[LeaseKey] = []
        self.used: dict[str, int] = {}
        self.oldest: dict[str, float] = {}

    def then(self, rows: Rows, reserved: Sequence[tuple[Any, ...]] = ()) -> list[Statement]:
        """The second half, decided from :attr:`first`'s rows (and the reservation's,
        ``reserved``, for the ``folded`` ones)."""
        sql = self.sql
        if self.folded:  # in the order asked
            rows_of = {row[0]: row for row in reserved}
            self.leases += [(t, int(rows_of[t][1]), rows_of[t][2])
                            for t in self.folded if t in rows_of]

        def of(name: str) -> list[tuple[Any, ...]]:
            return rows[self.at[name]] if name in self.at else []
        self.used = {key: int(count) for key, count in of("holders")}
        tally = rates.pg_tally(of("rate_count"), self.windows, self.wants)
        self.used.update(tally.used)
        self.oldest = tally.oldest
        asked = {(lease[0], lease[1], lease[2]) for lease in self.leases}
        live = {(task_id, int(epoch)) for task_id, epoch, token, reserved in of("live")
                if reserved and (task_id, int(epoch), token) in asked}
        granted, waiting, holds = decide(self.leases, self.wanted, self.used, live)
        self.granted, self.waiting = granted, waiting
        out: list[Statement] = []
        ids = [lease[0] for lease in granted]
        if granted and self.windows:
            out.append((sql["start_at"], (tally.now, self.ttl, ids)))
        elif granted:
            out.append((sql["start"], (self.ttl, ids)))
        if self.windows:
            grants = rate_grants(granted, self.wanted)
            recorded, bounds = rates.pg_record_params(tally, grants)
            if grants:
                out.append((sql["rate_record"], recorded))
            out.append((sql["rate_bound"], bounds))
        if holds:
            out.append((sql["forget"], ([lease[0] for lease in granted + waiting],)))
            out.append((sql["hold"], ([r["key"] for r in holds], [r["task_id"] for r in holds],
                                      [r["epoch"] for r in holds], [r["held"] for r in holds])))
        return out

    def outcome(self, rows: Rows) -> tuple[dict[str, float], Waiting]:
        """``(task_id -> lease_until, the waiting)``, from the transaction's rows of
        :attr:`first` and :meth:`then`'s statements, in order."""
        rows = rows[len(self.first):]
        started = {task_id: float(until) for task_id, until in rows[0]} if self.granted else {}
        return started, waiting_of(self.waiting, self.wanted, self.used, self.oldest)


def start_pipelined(pipeline: Pipeline, dialect: Dialect, holder: str,
                    leases: Sequence[LeaseKey], ttl: float,
                    needs: Mapping[str, Sequence[Permit]]) -> tuple[dict[str, float], set[str]]:
    """One batch of limited starts in a transaction of its own, on the pipeline."""
    plan = PermitPlan(dialect, holder, leases, ttl, needs)
    trips = TwoTrips.begin(pipeline, "start", plan.first, plan.then)
    trips.wait(None)
    return plan.outcome(trips.rows())
