"""A MySQL/MariaDB worker's usual exchange in one round trip: one multi-statement packet.

The usual exchange (completions without a ``pulse://`` result, reservations of task ids
the store has never seen, starts needing no permit) asks for no decision the server
cannot make itself. Each statement carries its rule in its ``WHERE``, the rows read back
say what it did, and the statements go with their ``COMMIT`` in one packet:

1. the completions' claims, read ``FOR UPDATE`` (the answers are decided from them);
2. a stale completion's evidence row, inserted unless its claim is live under its lease
   or already holds its outcome under its epoch (:func:`.claim_rows.stale_answers`'s
   rule, evaluated on the rows just locked);
3. the completions applied, one ``UPDATE`` per outcome, fenced by (task_id, epoch,
   token) and a live state: what the locked read called live, and nothing else;
4. the reservations inserted: a task id the store already has fails the ``INSERT`` with
   a duplicate key;
5. the starts' claims read ``FOR UPDATE``, moved to ``running`` by the same rule, read
   back: a start was made if its claim was live when locked and is running now;
6. ``COMMIT``.

An error stops the server at its statement: nothing after it runs, ``COMMIT``
included. The transaction is rolled back and the caller makes the exchange by the
general path (:class:`.mysql.MySqlClaims`: regrants, exhausted claims, contention),
which decides the same things a statement at a time. Only a lost connection is an
error here: the general path would meet it too.

The packet's parameters are interpolated by the driver (PyMySQL, mysqlclient) into the
text, escaped; MariaDB Connector/Python binds them server-side one statement at a time,
so it takes the general path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.store.base import (
    OPEN,
    RESERVED,
    RUNNING,
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    Refusal,
    ReserveRequest,
)
from celery_pulse.store.rules import OUTCOME_STATE
from celery_pulse.store.sql import mysql_sql as hot_sql
from celery_pulse.store.sql.claim_rows import applies, repeats, usual
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.engine import TRANSACTION_OPEN
from celery_pulse.store.sql.errors import translate, translated


class _Packet:
    """Statements, their parameters, and which result sets are read (by name)."""

    def __init__(self, sql: hot_sql.HotSql) -> None:
        self.sql = sql
        self.texts: list[str] = []
        self.params: list[Any] = []
        self.reads: list[str] = []

    def add(self, kind: str, rows: int, params: Sequence[Any], read: str = "") -> None:
        self.texts.append(self.sql.text(kind, rows))
        self.params.extend(params)
        self.reads.append(read)


def fits(completions: Sequence[Completion], reserves: Sequence[ReserveRequest],
         starts: Sequence[LeaseKey], packet: int | None) -> bool:
    """Whether the exchange is a usual one (see the module doc) the packet can carry:
    no reservation split by size (``packet``)."""
    return packet is None and usual(completions, reserves, starts)


class OnePacket:
    """Runs a usual exchange as one packet on a connection of the engine's pool."""

    def __init__(self, conns: Connections, hot: hot_sql.HotSql) -> None:
        self.conns = conns
        self.sql = hot
        self.dbapi: Any = conns.engine.dialect.loaded_dbapi
        #: Packets committed and the statements they carried (``COMMIT`` included), and
        #: packets refused: the worker's stats show them (the benchmarks' round trips).
        self.counts = {"packets": 0, "packet_statements": 0, "packets_refused": 0}

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 returning: Callable[[], bool]) -> Exchanged | None:
        """The exchange made, or None: it was rolled back, for the general path."""
        with translated("exchange"):  # the pool's own errors (exhausted)
            try:
                raw = self.conns.engine.raw_connection()
            except self.dbapi.Error as exc:  # no connection to be had: the store is down
                raise _lost(exc) from exc
        try:
            packet = self._packet(holder, ttl, completions, reserves, starts, returning())
            sets = self._run(raw, packet)
            if sets is None:
                self.counts["packets_refused"] += 1
                return None
            self.counts["packets"] += 1
            self.counts["packet_statements"] += len(packet.texts)
        finally:
            raw.close()
        got = dict(zip(packet.reads, sets, strict=True))
        got.pop("", None)
        return Exchanged(_completed(completions, got.get("completions", ())),
                         _reserved(reserves, got.get("grants", ())),
                         _started(got.get("locked", ()), got.get("started", ())), {})

    def _packet(self, holder: str, ttl: float, completions: Sequence[Completion],
                reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                returning: bool) -> _Packet:
        packet = _Packet(self.sql)
        if completions:
            rows = len(completions)
            packet.add("locked_for_completion", rows, [c.task_id for c in completions],
                       "completions")
            evidence: list[Any] = []
            groups: dict[tuple[str, str, str | None], list[Completion]] = {}
            for c in completions:
                state = OUTCOME_STATE[c.outcome]
                evidence += [c.task_id, c.epoch, holder, c.outcome, c.error, c.returned,
                             c.task_id, c.epoch, state, c.token]
                groups.setdefault((state, c.outcome, c.error), []).append(c)
            packet.add("evidence", rows, evidence)
            for (state, outcome, error), group in groups.items():
                packet.add("finish_fenced", len(group), [
                    state, outcome, error, state != OPEN, *(c.task_id for c in group),
                    *(part for c in group for part in (c.task_id, c.epoch, c.token))])
        if reserves:
            fresh = sorted(reserves, key=lambda r: r.task_id)  # one lock order
            params = hot_sql.insert_params(holder, ttl, [(r, 1, 1) for r in fresh])
            if returning:
                packet.add("insert_returning", len(fresh), params, "grants")
            else:
                packet.add("insert", len(fresh), params)
                packet.add("granted", len(fresh), [r.task_id for r in fresh], "grants")
        if starts:
            rows = len(starts)
            ids = [lease[0] for lease in starts]
            rule = [*ids, *(part for lease in starts for part in lease), holder, RESERVED]
            packet.add("locked_for_start", rows, rule, "locked")
            packet.add("start_fenced", rows, [ttl, *rule])
            packet.add("started", rows, ids, "started")
        packet.texts.append("COMMIT")
        packet.reads.append("")
        return packet

    def _run(self, raw: Any, packet: _Packet) -> list[Any] | None:
        """The packet's result sets; None when the server refused a statement of it."""
        raw.info[TRANSACTION_OPEN] = True  # until the packet's COMMIT is seen to have run
        try:
            cursor = raw.cursor()
            try:
                cursor.execute(";\n".join(packet.texts), tuple(packet.params))
                sets = [cursor.fetchall() if cursor.description else ()]
                while cursor.nextset():
                    sets.append(cursor.fetchall() if cursor.description else ())
            finally:
                cursor.close()
        except self.dbapi.Error as exc:
            try:
                raw.rollback()
            except self.dbapi.Error:  # the connection is gone: so is the store, for now
                raw.invalidate()
                raise _lost(exc) from exc
            raw.info[TRANSACTION_OPEN] = False
            return None
        raw.info[TRANSACTION_OPEN] = False
        return sets


def _lost(exc: Exception) -> Exception:
    """The pulse error for a driver error met with the connection lost (``exc`` itself
    if it is none of pulse's: a bug)."""
    return translate(exc, "exchange", True) or exc


def _completed(completions: Sequence[Completion], locked: Sequence[Any]) -> dict[str, str]:
    """Each completion's answer, by the rule the packet's statements applied."""
    rows = {task_id: (epoch, token, state) for task_id, epoch, token, state in locked}
    out: dict[str, str] = {}
    for c in completions:
        row = rows.get(c.task_id)
        if row is not None and applies(c, *row):
            out[c.task_id] = "applied"
        elif row is not None and repeats(c, row[0], row[2]):
            out[c.task_id] = "duplicate"
        else:
            out[c.task_id] = "evidence"
    return out


def _reserved(reserves: Sequence[ReserveRequest], rows: Sequence[Any]
              ) -> list[Grant | Refusal]:
    grants = hot_sql.grants(rows)
    return [grants[r.task_id] for r in reserves]


def _started(locked: Sequence[Any], now: Sequence[Any]) -> dict[str, float]:
    live = {row[0] for row in locked}
    return {task_id: float(until) for task_id, state, until in now
            if task_id in live and state == RUNNING}
