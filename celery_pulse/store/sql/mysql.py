"""The claim hot path on MySQL 8 / MariaDB 10.6+ (InnoDB).

MySQL has no ``ON CONFLICT .. WHERE`` and no ``RETURNING`` on UPDATE, so a grant here is
not one statement but one transaction that decides under row locks:

1. the claim rows are read ``FOR UPDATE`` with the store clock's verdict on expiry
   (``lease_until <= now`` evaluated by the server), never from a snapshot;
2. the decision is made from that locked read, by the same rules as the PostgreSQL
   statement (the shared contract suites hold both to it);
3. grants are written in multi-row statements, tokens minted by the server inside them;
   a task id nobody had is inserted with a plain ``INSERT``: if another transaction
   inserted it first, the duplicate-key error rolls everything back and the whole
   decision is taken again (it then sees the other grant, under lock);
4. what was written is read back under the same locks (MariaDB's ``INSERT .. RETURNING``
   answers a new claim's grant itself: :mod:`.mysql_sql`), and the transaction
   commits. A worker's exchange (completions, reservations, starts) is one transaction.

A usual exchange needs none of those decisions made in Python: its statements, each
with its rule in its ``WHERE``, go with their COMMIT in one packet
(:mod:`.mysql_packet`); what the packet cannot carry, or the server refuses in it, comes
here.

Deadlocks and lock-wait timeouts (1213/1205) roll a transaction back whole; it is run
again a few times (every one here is safe to repeat: nothing of it committed), then
reported as :class:`~celery_pulse.errors.Contended`, never as an outage or a lost lease
(:meth:`.connections.Connections.atomic`). The control plane's MySQL statements are in
:mod:`.mysql_control`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa

from celery_pulse.store.base import (
    LIVE_STATES,
    OPEN,
    RESERVED,
    TERMINAL_STATES,
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    PendingExchange,
    Permit,
    Refusal,
    ReserveRequest,
)
from celery_pulse.store.rules import (
    OUTCOME_STATE,
    grantable,
    new_publication,
    restarts,
    split_starts,
)
from celery_pulse.store.rules import rounds as in_rounds
from celery_pulse.store.sql import mysql_packet
from celery_pulse.store.sql import mysql_sql as hot_sql
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql.claim_rows import (
    CHUNK,
    applies,
    best,
    exhaust,
    lease_key_in,
    stale_answers,
)
from celery_pulse.store.sql.claim_rows import claimable as is_claimable
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.engine import MULTI_STATEMENT_DRIVERS
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.tables import CHECKPOINT_COLUMNS, claims

if TYPE_CHECKING:
    from celery_pulse.store.sql.pipeline import Pipeline

class MySqlClaims:
    """The hot path on MySQL/MariaDB (see the module doc): a sibling of
    :class:`~.claims.BatchClaims`, not a kind of it."""

    nonblocking_exchange = False
    folds_permits = False
    exchange_in_process = False
    pipeline: Pipeline | None = None
    #: A new claim's grant comes from its ``INSERT .. RETURNING`` (MariaDB 10.5+); MySQL
    #: has none and reads it back. None: asked of the connection at the first grant.
    returning_inserts: bool | None = None

    def __init__(self, conns: Connections, results: ResultRows) -> None:
        self.conns = conns
        self.dialect = conns.dialect
        self.results = results
        #: The server's ``max_allowed_packet`` (bytes), once asked.
        self._packet: int | None = None
        self.sql = hot_sql.HotSql(conns.dialect)
        #: The usual exchange in one round trip, where the driver can send it.
        self.packet = (mysql_packet.OnePacket(conns, self.sql)
                       if conns.engine.dialect.driver in MULTI_STATEMENT_DRIVERS else None)
        self.counts: Mapping[str, int] = self.packet.counts if self.packet else {}

    def close(self) -> None:
        """Nothing of its own to close (the store disposes of the engine)."""

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged | None:
        """Completions, then reservations, then starts, in one transaction (one COMMIT,
        not one per verb; if it raises, none took effect, as the contract allows); None
        (the three verbs, in order) when a start needs a permit."""
        limited, unique = split_starts(permits, starts)
        if limited:
            return None

        packet = self._packet_for(reserves)  # asked before: another connection
        done = self._one_packet(holder, ttl, completions, reserves, unique, packet)
        if done is not None:
            return done

        def body(conn: sa.Connection) -> Exchanged:
            completed, counted = self._complete_in(conn, holder, completions)
            reserved = self._reserve_in(conn, holder, reserves, ttl, packet)
            return Exchanged(completed, reserved, self._start_in(conn, holder, unique, ttl),
                             counted)

        return self.conns.atomic("exchange", body)

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None:
        return None

    def _one_packet(self, holder: str, ttl: float, completions: Sequence[Completion],
                    reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                    packet: int | None) -> Exchanged | None:
        """The exchange in one round trip (:mod:`.mysql_packet`), if it is a usual one
        and the driver can send it; None: for the general path, nothing done."""
        if self.packet is None or not mysql_packet.fits(completions, reserves, starts, packet):
            return None
        return self.packet.exchange(holder, ttl, completions, reserves, starts,
                                    self._returning)

    def _returning(self) -> bool:
        """Whether a new claim's grant comes from its ``INSERT`` (asked once, of a
        dialect that has connected)."""
        if self.returning_inserts is None:
            self.returning_inserts = bool(getattr(self.conns.engine.dialect, "is_mariadb",
                                                  False))
        return self.returning_inserts

    # -- reservations -------------------------------------------------------------------
    def max_message_bytes(self) -> int | None:
        """What ``max_allowed_packet`` leaves for the body once the statement's other
        columns have their share, with each byte of the body counted twice: PyMySQL sends
        bytes as hex, the C drivers escape them (twice the size at worst). Asked once."""
        if self._packet is None:
            with translated("max_message_bytes"), self.conns.engine.connect() as conn:
                self._packet = int(conn.exec_driver_sql(
                    "SELECT @@max_allowed_packet").scalar_one())
        return max(self._packet - hot_sql.PACKET_HEADROOM, 0) // 2

    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        if not requests:
            return []
        packet = self._packet_for(requests)
        done = self._one_packet(holder, ttl, [], requests, [], packet)
        if done is not None:
            return cast("list[Grant | Refusal]", list(done.reserved))  # never an error here
        return self.conns.atomic(
            "reserve", lambda conn: self._reserve_in(conn, holder, requests, ttl, packet))

    def _packet_for(self, requests: Sequence[ReserveRequest]) -> int | None:
        """The bytes of bodies one statement may carry, if any body is big enough to
        matter (asked of the server once, on a connection of its own)."""
        big = any(len(r.message.body) > hot_sql.PACKET_HEADROOM // 2 for r in requests)
        return self.max_message_bytes() if big else None

    def _reserve_in(self, conn: sa.Connection, holder: str, requests: Sequence[ReserveRequest],
                    ttl: float, packet: int | None) -> list[Grant | Refusal]:
        """:meth:`reserve` in the caller's transaction (``packet``: :meth:`_packet_for`)."""
        if not requests:
            return []
        out: list[Grant | Refusal | None] = [None] * len(requests)
        for batch in in_rounds(list(enumerate(requests)), lambda item: item[1].task_id):
            for chunk in hot_sql.chunks(batch, packet):
                answers = self._reserve_locked(conn, holder, [r for _, r in chunk], ttl)
                for (i, _), answer in zip(chunk, answers, strict=True):
                    out[i] = answer
        return [answer for answer in out if answer is not None]

    def _reserve_locked(self, conn: sa.Connection, holder: str,
                        requests: list[ReserveRequest], ttl: float) -> list[Grant | Refusal]:
        """Requests of distinct task ids, decided on their rows read under lock."""
        now = self.conns.now
        current = {r.task_id: r for r in conn.exec_driver_sql(
            self.sql.text("locked_for_grant", len(requests)),
            tuple(r.task_id for r in requests))}
        fresh: list[ReserveRequest] = []
        regrants: list[tuple[ReserveRequest, int, int]] = []  # (request, epoch, attempts)
        restarted: list[str] = []
        answers: dict[str, Grant | Refusal] = {}
        for req in requests:
            row = current.get(req.task_id)
            if row is None:
                fresh.append(req)
                continue
            new_pub = new_publication(req.publication, row.publication)
            if grantable(row.state, row.policy, bool(row.expired), row.attempts,
                         row.max_attempts, new_pub):
                if restarts(row.state, new_pub):
                    restarted.append(req.task_id)
                regrants.append((req, int(row.epoch) + 1,
                                 1 if new_pub else int(row.attempts) + 1))
                continue
            if row.state in TERMINAL_STATES:
                reason = "terminal"
            elif is_claimable(row) and row.attempts >= row.max_attempts and not new_pub:
                reason = "exhausted"
                exhaust(conn, now, row)
            else:
                reason = "taken"
            answers[req.task_id] = Refusal(req.task_id, reason, row.state, row.holder,
                                           int(row.epoch), int(row.retries), row.publication)
        fresh.sort(key=lambda r: r.task_id)  # one lock order across workers
        regrants.sort(key=lambda item: item[0].task_id)
        read_back = [r.task_id for r, _, _ in regrants]
        if fresh:
            params = hot_sql.insert_params(holder, ttl, [(r, 1, 1) for r in fresh])
            if self._returning():  # the rows it inserted: no read-back for them
                answers.update(hot_sql.grants(conn.exec_driver_sql(
                    self.sql.text("insert_returning", len(fresh)),
                    params)))
            else:
                conn.exec_driver_sql(self.sql.text("insert", len(fresh)),
                                     params)
                read_back += [r.task_id for r in fresh]
        if regrants:
            conn.exec_driver_sql(self.sql.text("regrant", len(regrants)),
                                 hot_sql.insert_params(holder, ttl, regrants))
        if restarted:  # a new run of a finished task: no earlier run's checkpoint
            conn.execute(sa.update(claims).where(claims.c.task_id.in_(restarted)).values(
                dict.fromkeys(CHECKPOINT_COLUMNS)))
        if read_back:
            answers.update(hot_sql.grants(conn.exec_driver_sql(
                self.sql.text("granted", len(read_back)), tuple(read_back))))
        return [answers[r.task_id] for r in requests]

    # -- running claims -----------------------------------------------------------------
    def _held(self, holder: str, leases: Sequence[LeaseKey], *states: str) -> Any:
        """Our live leases among ``leases`` (the id list lets the primary key be used)."""
        return sa.and_(claims.c.task_id.in_([lease[0] for lease in leases]),
                       lease_key_in(leases), claims.c.holder == holder,
                       claims.c.state.in_(states), claims.c.lease_until > self.conns.now)

    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        limited, unique = split_starts(permits, leases)
        started = permits_sql.start_limited(self.conns, holder, limited, ttl, permits or {},
                                            waiting)
        done = self._one_packet(holder, ttl, [], [], unique, None)
        if done is not None:
            started.update(done.started)
        elif unique:
            started.update(self.conns.atomic(
                "start", lambda conn: self._start_in(conn, holder, unique, ttl)))
        return started

    def _start_in(self, conn: sa.Connection, holder: str, leases: Sequence[LeaseKey],
                  ttl: float) -> dict[str, float]:
        """Starts needing no permit, in the caller's transaction."""
        started: dict[str, float] = {}
        for i in range(0, len(leases), CHUNK):
            chunk = leases[i:i + CHUNK]
            ids = [task_id for task_id, in conn.exec_driver_sql(
                self.sql.text("locked_for_start", len(chunk)),
                (*(lease[0] for lease in chunk), *(part for lease in chunk for part in lease),
                 holder, RESERVED))]
            if not ids:
                continue
            conn.exec_driver_sql(self.sql.text("start", len(ids)), (ttl, *ids))
            started.update((task_id, float(until)) for task_id, until in conn.exec_driver_sql(
                self.sql.text("leases", len(ids)), tuple(ids)))
        return started

    def renew(self, holder: str, leases: Sequence[LeaseKey], ttl: float
              ) -> tuple[set[str], set[str]]:
        renewed: set[str] = set()
        busy: set[str] = set()
        now = self.conns.now
        for i in range(0, len(leases), CHUNK):
            chunk = leases[i:i + CHUNK]

            def body(conn: sa.Connection, chunk: Sequence[Any] = chunk
                     ) -> tuple[set[str], set[str]]:
                held = self._held(holder, chunk, *LIVE_STATES)
                # Skip rows a fenced transaction holds: waiting would stall every lease.
                got = set(conn.execute(sa.select(claims.c.task_id).where(held)
                                       .with_for_update(skip_locked=True)).scalars())
                if got:
                    conn.execute(sa.update(claims).where(claims.c.task_id.in_(got))
                                 .values(lease_until=now + ttl))
                missing = [lease for lease in chunk if lease[0] not in got]
                locked: set[str] = set()
                if missing:
                    locked = set(conn.execute(sa.select(claims.c.task_id).where(
                        self._held(holder, missing, *LIVE_STATES))).scalars())
                return got, locked

            got, locked = self.conns.atomic("renew", body)
            renewed |= got
            busy |= locked
        return renewed, busy

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """As on PostgreSQL (see the contract); applied in statements per outcome."""
        done = self._one_packet(holder, 0.0, completions, [], [], None)
        if done is not None:
            return cast("dict[str, str]", dict(done.completed))  # never an error here
        out, counts = self.conns.atomic(
            "complete", lambda conn: self._complete_in(conn, holder, completions))
        if counted is not None:
            counted.update(counts)
        return out

    def _complete_in(self, conn: sa.Connection, holder: str, completions: Sequence[Completion]
                     ) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
        """:meth:`complete` in the caller's transaction: the answers, and the parts of
        the results it counted (of this attempt: a transaction run again redoes them)."""
        out: dict[str, str] = {}
        all_counts: dict[str, tuple[int, str]] = {}
        for batch in in_rounds(list(completions), lambda c: c.task_id):
            for i in range(0, len(batch), CHUNK):
                answers, counts = self._complete_locked(conn, holder, batch[i:i + CHUNK])
                all_counts.update(counts)
                best(out, answers)
        return out, all_counts

    def _complete_locked(self, conn: sa.Connection, holder: str, chunk: list[Completion]
                         ) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
        now = self.conns.now
        current = {r.task_id: r for r in conn.exec_driver_sql(
            self.sql.text("locked_for_completion", len(chunk)),
            tuple(c.task_id for c in chunk))}
        groups: dict[tuple[str, str, str | None], list[str]] = {}
        stale: list[Completion] = []
        for c in chunk:
            row = current.get(c.task_id)
            if row is not None and applies(c, row.epoch, row.token, row.state):
                groups.setdefault((OUTCOME_STATE[c.outcome], c.outcome, c.error),
                                  []).append(c.task_id)
            else:
                stale.append(c)
        answers: dict[str, str] = {}
        for (state, outcome, error), ids in groups.items():
            conn.exec_driver_sql(self.sql.text("finish", len(ids)),
                                 (state, outcome, error, state != OPEN, *ids))
            answers.update(dict.fromkeys(ids, "applied"))
        mine = [c for c in chunk if c.result is not None and answers.get(c.task_id) == "applied"]
        self.results.write_fenced(conn, [c.result for c in mine if c.result is not None])
        counts = self.results.count_parts(
            conn, [(c.task_id, c.result) for c in mine if c.result is not None])
        if stale:
            answers.update(stale_answers(conn, holder, stale, now))
        return answers, counts
