"""The store contract on MySQL 8 / MariaDB 10.6+ (InnoDB).

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
4. what was written is read back under the same locks, and the transaction commits.

Deadlocks and lock-wait timeouts (1213/1205) roll a transaction back whole; it is run
again a few times (every one here is safe to repeat: nothing of it committed), then
reported as :class:`~celery_pulse.errors.Contended`, never as an outage or a lost lease.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from celery_pulse.errors import Contended, NotRegistered
from celery_pulse.store.base import (
    FAILED,
    FINISHED_STATES,
    LIVE_STATES,
    OPEN,
    RESERVED,
    RESTARTABLE_STATES,
    RUNNING,
    TERMINAL_STATES,
    Completion,
    Grant,
    Heartbeat,
    LeaderGrant,
    Permit,
    Refusal,
    Registration,
    ReserveRequest,
    ScheduleRow,
    Slot,
)
from celery_pulse.store.sql import permits as _permits
from celery_pulse.store.sql.errors import mysql_code, translated
from celery_pulse.store.sql.store import (
    _CHUNK,
    _OUTCOME_STATE,
    _RANK,
    SqlStore,
    _dumps,
    _rounds,
)
from celery_pulse.store.sql.tables import (
    beat_slots,
    beat_state,
    claims,
    drains,
    evidence,
    leaders,
    schedule,
    workers,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Attempts of one transaction that keeps meeting deadlocks or duplicate-key races.
_ATTEMPTS = 6
_DUPLICATE_KEY = 1062

#: The columns of a reservation's INSERT, in order (the server fills token and times).
_INSERT_COLUMNS = ("task_id", "task_name", "state", "holder", "token", "epoch", "lease_until",
                   "attempts", "max_attempts", "policy", "retries", "body", "headers",
                   "properties", "delivery_info", "content_type", "content_encoding",
                   "publication", "created_at", "reserved_at", "started_at")
#: Columns a re-grant overwrites (``created_at`` and ``max_attempts`` stay).
_REGRANT_COLUMNS = ("state", "holder", "token", "epoch", "lease_until", "attempts", "policy",
                    "retries", "task_name", "body", "headers", "properties", "delivery_info",
                    "content_type", "content_encoding", "reserved_at", "publication",
                    "started_at")


def _claimable(row: Any) -> bool:
    """Open, or reserved and expired, or a redispatch-policy run that expired."""
    return bool(row.state == OPEN or (row.state == RESERVED and row.expired)
                or (row.state == RUNNING and row.policy == "redispatch" and row.expired))


#: Of ``max_allowed_packet``, what the reservation statement's text and the row's other
#: columns may need besides the body (bytes).
_PACKET_HEADROOM = 1 << 20


def _chunks(batch: list[tuple[int, ReserveRequest]], packet: int | None
            ) -> list[list[tuple[int, ReserveRequest]]]:
    """``batch`` in statements of at most ``_CHUNK`` rows and, with big messages, of
    bodies adding up to at most ``packet`` bytes: over ``max_allowed_packet`` the server
    drops the connection, as an outage would."""
    if packet is None:
        return [batch[i:i + _CHUNK] for i in range(0, len(batch), _CHUNK)]
    chunks: list[list[tuple[int, ReserveRequest]]] = [[]]
    size = 0
    for item in batch:
        grows = len(item[1].message.body)
        if chunks[-1] and (size + grows > packet or len(chunks[-1]) >= _CHUNK):
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += grows
    return chunks


class MySqlStore(SqlStore):
    """A :class:`~celery_pulse.store.base.Store` on MySQL/MariaDB (see the module doc)."""

    #: The server's ``max_allowed_packet`` (bytes), once asked.
    _packet: int | None = None

    # -- transactions -------------------------------------------------------------------
    def _atomic(self, where: str, body: Callable[[sa.Connection], T]) -> T:
        """Run ``body`` in one transaction; again (whole) after a deadlock, a lock-wait
        timeout or a lost duplicate-key race, with a short jittered backoff."""
        delay = 0.005
        for attempt in range(_ATTEMPTS):
            try:
                with translated(where), self.engine.begin() as conn:
                    return body(conn)
            except Contended as exc:
                if attempt == _ATTEMPTS - 1:
                    raise
                why = str(exc)
            except sa_exc.IntegrityError as exc:
                if mysql_code(exc.orig) != _DUPLICATE_KEY or attempt == _ATTEMPTS - 1:
                    raise
                why = "another transaction inserted the same key first"
            logger.debug("pulse: %s rolled back (%s): running it again", where, why)
            time.sleep(delay * (0.5 + random.random()))
            delay *= 2
        raise Contended(f"store contended during {where}")  # pragma: no cover

    def _updated(self, conn: sa.Connection, task_ids: list[str], stmt: Any) -> list[Any]:
        conn.execute(stmt)
        return list(conn.execute(sa.select(claims.c.task_id, claims.c.epoch, claims.c.token)
                                 .where(claims.c.task_id.in_(task_ids))))

    def _sql(self, kind: str, rows: int, build: Callable[[int], str]) -> str:
        cached = self._sql_cache.get((kind, rows))
        if cached is None:
            cached = self._sql_cache[(kind, rows)] = build(rows)
        return cached

    # -- worker registry ----------------------------------------------------------------
    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        now = self._now
        drained = sa.exists().where(drains.c.worker_id == worker_id)
        values = dict(token=self.dialect.new_token(),
                      labels=_dumps(labels), registered_at=now, last_heartbeat=now,
                      expires_at=now + ttl, draining=drained)

        def body(conn: sa.Connection) -> Any:
            current = conn.execute(
                sa.select(workers.c.token, (workers.c.expires_at <= now).label("expired"))
                .where(workers.c.worker_id == worker_id).with_for_update()).one_or_none()
            if current is None:
                conn.execute(sa.insert(workers).values(worker_id=worker_id, **values))
            elif replace_live or current.expired:
                conn.execute(sa.update(workers).where(workers.c.worker_id == worker_id)
                             .values(**values))
            else:
                return None
            return conn.execute(sa.select(workers.c.token, workers.c.expires_at,
                                          workers.c.draining)
                                .where(workers.c.worker_id == worker_id)).one()

        row = self._atomic("register", body)
        if row is None:
            raise NotRegistered(f"{worker_id}: another process registered this name",
                                reason=NotRegistered.REPLACED)
        return Registration(worker_id, row.token, float(row.expires_at), bool(row.draining))

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        def body(conn: sa.Connection) -> None:
            if draining:
                stmt = self.dialect.insert(drains).values(
                    worker_id=worker_id, requested_by=who, requested_at=self._now)
                conn.execute(stmt.on_duplicate_key_update(worker_id=drains.c.worker_id))
            else:
                conn.execute(sa.delete(drains).where(drains.c.worker_id == worker_id))
            conn.execute(sa.update(workers).where(workers.c.worker_id == worker_id)
                         .values(draining=draining))
        self._atomic("set_drain", body)

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        now = self._now

        def body(conn: sa.Connection) -> Any:
            # One statement decides (the row is locked by it); read back under that lock.
            if conn.execute(sa.update(workers).where(
                    workers.c.worker_id == worker_id, workers.c.token == token,
                    workers.c.expires_at > now).values(
                    expires_at=now + ttl, last_heartbeat=now)).rowcount:
                row = conn.execute(sa.select(workers.c.expires_at, workers.c.draining).where(
                    workers.c.worker_id == worker_id)).one()
                return Heartbeat(float(row.expires_at), bool(row.draining))
            return conn.execute(
                sa.select(workers.c.token, (workers.c.expires_at > now).label("alive"))
                .where(workers.c.worker_id == worker_id)).one_or_none()

        got = self._atomic("heartbeat", body)
        if isinstance(got, Heartbeat):
            return got
        if got is None:
            raise NotRegistered(f"{worker_id}: not registered", reason=NotRegistered.MISSING)
        if got.token != token and got.alive:
            raise NotRegistered(f"{worker_id}: another process registered this name",
                                reason=NotRegistered.REPLACED)
        raise NotRegistered(f"{worker_id}: registration expired", reason=NotRegistered.EXPIRED)

    # -- reservations -------------------------------------------------------------------
    def max_message_bytes(self) -> int | None:
        """What ``max_allowed_packet`` leaves for the body once the statement's other
        columns have their share, with each byte of the body counted twice: PyMySQL sends
        bytes as hex, the C drivers escape them (twice the size at worst). Asked once."""
        if self._packet is None:
            with translated("max_message_bytes"), self.engine.connect() as conn:
                self._packet = int(conn.exec_driver_sql(
                    "SELECT @@max_allowed_packet").scalar_one())
        return max(self._packet - _PACKET_HEADROOM, 0) // 2

    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        if not requests:
            return []
        rounds = _rounds(list(enumerate(requests)), lambda item: item[1].task_id)
        packet = self.max_message_bytes() if any(
            len(r.message.body) > _PACKET_HEADROOM // 2 for r in requests) else None

        def body(conn: sa.Connection) -> list[Grant | Refusal]:
            out: list[Grant | Refusal | None] = [None] * len(requests)
            for batch in rounds:
                for chunk in _chunks(batch, packet):
                    answers = self._reserve_locked(conn, holder, [r for _, r in chunk], ttl)
                    for (i, _), answer in zip(chunk, answers, strict=True):
                        out[i] = answer
            return [answer for answer in out if answer is not None]

        return self._atomic("reserve", body)

    def _reserve_locked(self, conn: sa.Connection, holder: str,
                        requests: list[ReserveRequest], ttl: float) -> list[Grant | Refusal]:
        """Requests of distinct task ids, decided on their rows read under lock."""
        now = self._now
        current = {r.task_id: r for r in conn.execute(
            sa.select(claims.c.task_id, claims.c.state, claims.c.holder, claims.c.epoch,
                      claims.c.attempts, claims.c.max_attempts, claims.c.retries,
                      claims.c.policy, claims.c.publication,
                      (claims.c.lease_until <= now).label("expired"))
            .where(claims.c.task_id.in_([r.task_id for r in requests])).with_for_update())}
        fresh: list[ReserveRequest] = []
        regrants: list[tuple[ReserveRequest, int, int]] = []  # (request, epoch, attempts)
        answers: dict[str, Grant | Refusal] = {}
        for req in requests:
            row = current.get(req.task_id)
            if row is None:
                fresh.append(req)
                continue
            new_pub = req.publication is not None and req.publication != row.publication
            claimable = _claimable(row)
            if ((new_pub or row.attempts < row.max_attempts) and claimable) or (
                    new_pub and row.state in RESTARTABLE_STATES):
                regrants.append((req, int(row.epoch) + 1,
                                 1 if new_pub else int(row.attempts) + 1))
                continue
            if row.state in TERMINAL_STATES:
                reason = "terminal"
            elif claimable and row.attempts >= row.max_attempts and not new_pub:
                reason = "exhausted"
                conn.execute(sa.update(claims).where(
                    claims.c.task_id == row.task_id, claims.c.epoch == row.epoch).values(
                    state=FAILED, outcome="exhausted", finished_at=now, lease_until=None,
                    token=None, error=f"attempt budget exhausted ({row.attempts} of "
                                      f"{row.max_attempts} reservations used)"))
            else:
                reason = "taken"
            answers[req.task_id] = Refusal(req.task_id, reason, row.state, row.holder,
                                           int(row.epoch), int(row.retries), row.publication)
        fresh.sort(key=lambda r: r.task_id)  # one lock order across workers
        regrants.sort(key=lambda item: item[0].task_id)
        if fresh:
            conn.exec_driver_sql(self._sql("reserve-new", len(fresh), self._insert_sql),
                                 self._insert_params(holder, ttl, [(r, 1, 1) for r in fresh]))
        if regrants:
            conn.exec_driver_sql(self._sql("reserve-again", len(regrants), self._regrant_sql),
                                 self._insert_params(holder, ttl, regrants))
        granted = [r.task_id for r in fresh] + [r.task_id for r, _, _ in regrants]
        if granted:
            for task_id, epoch, token, lease_until, attempts, state in conn.execute(
                    sa.select(claims.c.task_id, claims.c.epoch, claims.c.token,
                              claims.c.lease_until, claims.c.attempts, claims.c.state)
                    .where(claims.c.task_id.in_(granted))):
                answers[task_id] = Grant(task_id, int(epoch), token, float(lease_until),
                                         int(attempts), state == RUNNING)
        return [answers[r.task_id] for r in requests]

    def _insert_sql(self, rows: int) -> str:
        now, token = self.dialect._now, self.dialect._token
        row = (f"(%s, %s, %s, %s, {token}, %s, {now} + %s, %s, %s, %s, %s, %s, %s, %s, %s, "
               f"%s, %s, %s, {now}, {now}, IF(%s, {now}, NULL))")
        return (f"INSERT INTO pulse_claims ({', '.join(_INSERT_COLUMNS)}) VALUES "
                + ", ".join([row] * rows))

    def _regrant_sql(self, rows: int) -> str:
        """The rows exist and are locked by this transaction: the upsert only updates."""
        assign = ", ".join(f"{c} = VALUES({c})" for c in _REGRANT_COLUMNS)
        return (f"{self._insert_sql(rows)} ON DUPLICATE KEY UPDATE {assign}, "
                f"finished_at = NULL, outcome = NULL, error = NULL")

    @staticmethod
    def _insert_params(holder: str, ttl: float,
                       items: list[tuple[ReserveRequest, int, int]]) -> tuple[Any, ...]:
        params: list[Any] = []
        for r, epoch, attempts in items:
            params += [r.task_id, r.task_name, RUNNING if r.start else RESERVED, holder, epoch,
                       ttl, attempts, r.max_attempts, r.policy, r.retries, r.message.body,
                       _dumps(r.message.headers), _dumps(r.message.properties),
                       _dumps(r.message.delivery_info), r.message.content_type,
                       r.message.content_encoding, r.publication, r.start]
        return tuple(params)

    # -- running claims -----------------------------------------------------------------
    def _held(self, holder: str, leases: Sequence[tuple[str, int, str]], *states: str) -> Any:
        """Our live leases among ``leases`` (the id list lets the primary key be used)."""
        return sa.and_(claims.c.task_id.in_([lease[0] for lease in leases]),
                       self._lease_key(leases), claims.c.holder == holder,
                       claims.c.state.in_(states), claims.c.lease_until > self._now)

    def start_many(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        now = self._now
        limited, unique = _permits.as_needs(permits, list(dict.fromkeys(
            (lease[0], lease[1], lease[2]) for lease in leases)))
        started = self._start_limited(holder, limited, ttl, permits or {}, waiting)
        for i in range(0, len(unique), _CHUNK):
            chunk: list[Any] = unique[i:i + _CHUNK]

            def body(conn: sa.Connection, chunk: list[Any] = chunk) -> dict[str, float]:
                ids = list(conn.execute(sa.select(claims.c.task_id).where(
                    self._held(holder, chunk, RESERVED)).with_for_update()).scalars())
                if not ids:
                    return {}
                conn.execute(sa.update(claims).where(claims.c.task_id.in_(ids)).values(
                    state=RUNNING, started_at=now, lease_until=now + ttl))
                return {task_id: float(until) for task_id, until in conn.execute(
                    sa.select(claims.c.task_id, claims.c.lease_until)
                    .where(claims.c.task_id.in_(ids)))}

            started.update(self._atomic("start", body))
        return started

    def renew(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float
              ) -> tuple[set[str], set[str]]:
        renewed: set[str] = set()
        busy: set[str] = set()
        now = self._now
        for i in range(0, len(leases), _CHUNK):
            chunk = leases[i:i + _CHUNK]

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

            got, locked = self._atomic("renew", body)
            renewed |= got
            busy |= locked
        return renewed, busy

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """As on PostgreSQL (see the contract); applied in statements per outcome."""
        rounds = _rounds(list(completions), lambda c: c.task_id)

        def body(conn: sa.Connection) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
            out: dict[str, str] = {}
            all_counts: dict[str, tuple[int, str]] = {}  # of this attempt (a retry redoes it)
            for batch in rounds:
                for i in range(0, len(batch), _CHUNK):
                    answers, counts = self._complete_locked(conn, holder,
                                                            batch[i:i + _CHUNK])
                    all_counts.update(counts)
                    for task_id, answer in answers.items():
                        if _RANK[answer] > _RANK.get(out.get(task_id, ""), -1):
                            out[task_id] = answer
            return out, all_counts

        out, counts = self._atomic("complete", body)
        if counted is not None:
            counted.update(counts)
        return out

    def _complete_locked(self, conn: sa.Connection, holder: str, chunk: list[Completion]
                         ) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
        now = self._now
        current = {r.task_id: r for r in conn.execute(
            sa.select(claims.c.task_id, claims.c.epoch, claims.c.token, claims.c.state)
            .where(claims.c.task_id.in_([c.task_id for c in chunk])).with_for_update())}
        groups: dict[tuple[str, str, str | None], list[str]] = {}
        stale: list[Completion] = []
        for c in chunk:
            row = current.get(c.task_id)
            if row is not None and int(row.epoch) == c.epoch and row.token == c.token and (
                    row.state in (RESERVED, RUNNING)):
                groups.setdefault((_OUTCOME_STATE[c.outcome], c.outcome, c.error),
                                  []).append(c.task_id)
            else:
                stale.append(c)
        answers: dict[str, str] = {}
        for (state, outcome, error), ids in groups.items():
            # A retry reopens the claim for its next delivery: no finished_at.
            conn.execute(sa.update(claims).where(claims.c.task_id.in_(ids)).values(
                state=state, outcome=outcome, error=error, token=None, lease_until=None,
                finished_at=None if state == OPEN else now))
            answers.update(dict.fromkeys(ids, "applied"))
        mine = [c for c in chunk if c.result is not None and answers.get(c.task_id) == "applied"]
        self._results().write_fenced(conn, [c.result for c in mine if c.result is not None])
        counts = self._results().count_parts(
            conn, [(c.task_id, c.result) for c in mine if c.result is not None])
        if stale:
            answers.update(self._stale(conn, holder, stale, now))
        return answers, counts

    def purge_finished(self, older_than: float, limit: int = 500) -> int:
        now = self._now

        def body(conn: sa.Connection) -> int:
            # MySQL takes no LIMIT in an IN subquery; a single-table DELETE takes one.
            deleted = conn.execute(
                sa.delete(claims).where(claims.c.state.in_(FINISHED_STATES),
                                        claims.c.finished_at < now - older_than)
                .with_dialect_options(mysql_limit=limit)).rowcount
            conn.execute(sa.delete(evidence).where(evidence.c.recorded_at < now - older_than)
                         .with_dialect_options(mysql_limit=limit))
            _permits.purge(conn, self.dialect, older_than, limit)
            return int(deleted)

        deleted = self._atomic("purge", body)
        self._results().purge_expired(limit)
        return deleted

    # -- leader election and beat --------------------------------------------------------
    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        now = self._now

        def body(conn: sa.Connection) -> Any:
            row = conn.execute(
                sa.select(leaders.c.token, (leaders.c.lease_until <= now).label("expired"))
                .where(leaders.c.key == key).with_for_update()).one_or_none()
            if row is None:
                conn.execute(sa.insert(leaders).values(
                    key=key, holder=holder, token=self.dialect.new_token(), epoch=1,
                    lease_until=now + ttl, acquired_at=now))
            elif token is not None and row.token == token:  # our term: extend it
                conn.execute(sa.update(leaders).where(leaders.c.key == key).values(
                    holder=holder, lease_until=now + ttl))
            elif row.expired:  # a new term
                conn.execute(sa.update(leaders).where(leaders.c.key == key).values(
                    holder=holder, token=self.dialect.new_token(), epoch=leaders.c.epoch + 1,
                    lease_until=now + ttl, acquired_at=now))
            else:
                return None
            return conn.execute(sa.select(leaders.c.holder, leaders.c.token, leaders.c.epoch,
                                          leaders.c.lease_until)
                                .where(leaders.c.key == key)).one()

        row = self._atomic("try_acquire", body)
        if row is None:
            return None
        return LeaderGrant(key, row.holder, row.token, int(row.epoch), float(row.lease_until))

    def init_last_run(self, entry: str, at: float) -> float:
        stmt = self.dialect.insert(beat_state).values(entry=entry, last_run_at=at)
        stmt = stmt.on_duplicate_key_update(last_run_at=beat_state.c.last_run_at)

        def body(conn: sa.Connection) -> float:
            conn.execute(stmt)
            return float(conn.execute(sa.select(beat_state.c.last_run_at).where(
                beat_state.c.entry == entry)).scalar_one())

        return self._atomic("init_last_run", body)

    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        now = self._now
        # The term's row stays locked until the slot is decided: a takeover waits.
        term = (sa.select(leaders.c.key)
                .where(leaders.c.key == key, leaders.c.token == token, leaders.c.epoch == epoch,
                       leaders.c.lease_until > now).with_for_update())
        state = self.dialect.insert(beat_state).values(entry=slot.entry, last_run_at=slot.due_at)
        state = state.on_duplicate_key_update(last_run_at=sa.func.greatest(
            beat_state.c.last_run_at, state.inserted.last_run_at))

        def body(conn: sa.Connection) -> bool:
            if conn.execute(term).first() is None:
                return False
            exists = conn.execute(sa.select(beat_slots.c.entry).where(
                beat_slots.c.entry == slot.entry, beat_slots.c.due_at == slot.due_at
            ).with_for_update()).first()
            if exists is None:
                conn.execute(sa.insert(beat_slots).values(
                    entry=slot.entry, due_at=slot.due_at, task_id=slot.task_id,
                    task=slot.task, payload=slot.payload, leader_epoch=epoch, created_at=now))
            conn.execute(state)
            return exists is None

        return self._atomic("fire_slot", body)

    def put_schedule(self, row: ScheduleRow) -> None:
        values = dict(name=row.name, task=row.task, kind=row.kind, spec=row.spec, args=row.args,
                      kwargs=row.kwargs, options=row.options, enabled=row.enabled,
                      updated_at=self._now)
        stmt = self.dialect.insert(schedule).values(**values)
        stmt = stmt.on_duplicate_key_update(
            **{k: stmt.inserted[k] for k in values if k != "name"})
        self._atomic("put_schedule", lambda conn: conn.execute(stmt))
