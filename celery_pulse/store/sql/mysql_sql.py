"""The statements of the MySQL/MariaDB hot path (:mod:`.mysql`, :mod:`.mysql_packet`), as text.

They go to the driver as they are (``exec_driver_sql``), built once per row count: what
SQLAlchemy Core would do per call (build the statement, its cache key, expand the ``IN``
list) cost more than the driver's round trip. A grant is a multi-row ``INSERT`` (an
upsert for a claim granted again), with the store's clock and a token minted by the
server in it; the grants are read back under the transaction's locks, or (MariaDB) taken
from the ``INSERT``'s own ``RETURNING``.
"""

from __future__ import annotations

from typing import Any

from celery_pulse.store.base import RESERVED, RUNNING, Grant, ReserveRequest
from celery_pulse.store.rules import queue_of
from celery_pulse.store.sql.claim_rows import CHUNK, LIVE_SQL, dumps
from celery_pulse.store.sql.dialect import Dialect

#: The columns of a reservation's INSERT, in order (the server fills token and times).
INSERT_COLUMNS = ("task_id", "task_name", "state", "holder", "token", "epoch", "lease_until",
                  "attempts", "max_attempts", "policy", "retries", "body", "headers",
                  "properties", "delivery_info", "content_type", "content_encoding",
                  "publication", "queue", "created_at", "reserved_at", "started_at")
#: Columns a re-grant overwrites (``created_at`` and ``max_attempts`` stay).
REGRANT_COLUMNS = ("state", "holder", "token", "epoch", "lease_until", "attempts", "policy",
                   "retries", "task_name", "body", "headers", "properties", "delivery_info",
                   "content_type", "content_encoding", "reserved_at", "publication",
                   "queue", "started_at")
#: What a grant is read from (in this order): the read-back, or MariaDB's ``RETURNING``.
GRANT_COLUMNS = ("task_id", "epoch", "token", "lease_until", "attempts", "state")
#: Of ``max_allowed_packet``, what the reservation statement's text and the row's other
#: columns may need besides the body (bytes).
PACKET_HEADROOM = 1 << 20


class HotSql:
    """The statements' text, for ``rows`` rows: :meth:`text` builds each once per size."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._cache: dict[tuple[str, int], str] = {}

    def text(self, kind: str, rows: int) -> str:
        """The statement built by the method named ``kind``, for ``rows`` rows."""
        cached = self._cache.get((kind, rows))
        if cached is None:
            cached = self._cache[(kind, rows)] = getattr(self, kind)(rows)
        return cached

    @staticmethod
    def _keys(rows: int) -> str:
        return f"(task_id, epoch, token) IN ({', '.join(['(%s, %s, %s)'] * rows)})"

    @staticmethod
    def _ids(rows: int) -> str:
        return f"task_id IN ({', '.join(['%s'] * rows)})"

    def locked_for_grant(self, rows: int) -> str:
        """The claims a reservation decides on, locked; ``expired`` by the store clock."""
        return ("SELECT task_id, state, holder, epoch, attempts, max_attempts, retries, "
                f"policy, publication, lease_until <= {self.dialect.clock} AS expired "
                f"FROM pulse_claims WHERE {self._ids(rows)} FOR UPDATE")

    def _startable(self, rows: int) -> str:
        """After :meth:`_ids`: the leases' (task_id, epoch, token) flattened, the holder
        and the state, and a lease the store clock says is live."""
        return (f"AND {self._keys(rows)} AND holder = %s AND state = %s "
                f"AND lease_until > {self.dialect.clock}")

    def locked_for_start(self, rows: int) -> str:
        """A holder's live reservations among ``rows`` leases, locked (parameters: the
        ids, the leases' (task_id, epoch, token) flattened, the holder, the state)."""
        return (f"SELECT task_id FROM pulse_claims WHERE {self._ids(rows)} "
                f"{self._startable(rows)} FOR UPDATE")

    def start_fenced(self, rows: int) -> str:
        """The start under :meth:`locked_for_start`'s rule (parameters: the ttl, then
        its parameters), for a packet that cannot wait for the locked read's answer."""
        return f"{self.start(rows)} {self._startable(rows)}"

    def started(self, rows: int) -> str:
        return f"SELECT task_id, state, lease_until FROM pulse_claims WHERE {self._ids(rows)}"

    def start(self, rows: int) -> str:
        """Parameters: the ttl, then the ids (locked by :meth:`locked_for_start`)."""
        now = self.dialect.clock
        return (f"UPDATE pulse_claims SET state = '{RUNNING}', started_at = {now}, "
                f"lease_until = {now} + %s WHERE {self._ids(rows)}")

    def leases(self, rows: int) -> str:
        return f"SELECT task_id, lease_until FROM pulse_claims WHERE {self._ids(rows)}"

    def locked_for_completion(self, rows: int) -> str:
        return (f"SELECT task_id, epoch, token, state FROM pulse_claims "
                f"WHERE {self._ids(rows)} FOR UPDATE")

    def finish(self, rows: int) -> str:
        """Completions of one outcome (parameters: state, outcome, error, whether it
        finishes, then the ids); a retry reopens the claim: no ``finished_at``."""
        return ("UPDATE pulse_claims SET state = %s, outcome = %s, error = %s, token = NULL, "
                f"lease_until = NULL, finished_at = IF(%s, {self.dialect.clock}, NULL) "
                f"WHERE {self._ids(rows)}")

    def finish_fenced(self, rows: int) -> str:
        """:meth:`finish`, then the leases' (task_id, epoch, token) flattened: only what
        :meth:`locked_for_completion` found live under that lease."""
        return f"{self.finish(rows)} AND {self._keys(rows)} AND state IN ({LIVE_SQL})"

    def evidence(self, rows: int) -> str:
        """Per completion (task_id, epoch, holder, outcome, error, returned, then task_id,
        epoch, the outcome's state, token): its evidence row, if its claim neither is
        live under its lease nor holds its outcome under its epoch
        (:func:`.claim_rows.stale_answers`'s rule, on rows locked before)."""
        one = (f"SELECT %s, %s, %s, %s, %s, {self.dialect.clock}, %s FROM DUAL WHERE NOT "
               "EXISTS (SELECT 1 FROM pulse_claims WHERE task_id = %s AND epoch = %s AND "
               f"(state = %s OR (token = %s AND state IN ({LIVE_SQL}))))")
        return ("INSERT INTO pulse_evidence (task_id, epoch, holder, outcome, error, "
                "recorded_at, result) " + " UNION ALL ".join([one] * rows))

    def insert(self, rows: int) -> str:
        now, token = self.dialect.clock, self.dialect.token
        row = (f"(%s, %s, %s, %s, {token}, %s, {now} + %s, %s, %s, %s, %s, %s, %s, %s, %s, "
               f"%s, %s, %s, %s, {now}, {now}, IF(%s, {now}, NULL))")
        return (f"INSERT INTO pulse_claims ({', '.join(INSERT_COLUMNS)}) VALUES "
                + ", ".join([row] * rows))

    def granted(self, rows: int) -> str:
        """The read-back of grants (:data:`GRANT_COLUMNS`), under the insert's locks."""
        return f"SELECT {', '.join(GRANT_COLUMNS)} FROM pulse_claims WHERE {self._ids(rows)}"

    def insert_returning(self, rows: int) -> str:
        """MariaDB 10.5+ (MySQL has no ``RETURNING``)."""
        return f"{self.insert(rows)} RETURNING {', '.join(GRANT_COLUMNS)}"

    def regrant(self, rows: int) -> str:
        """The rows exist and are locked by this transaction: the upsert only updates."""
        assign = ", ".join(f"{c} = VALUES({c})" for c in REGRANT_COLUMNS)
        return (f"{self.insert(rows)} ON DUPLICATE KEY UPDATE {assign}, "
                f"finished_at = NULL, outcome = NULL, error = NULL")


def insert_params(holder: str, ttl: float, items: list[tuple[ReserveRequest, int, int]]
                  ) -> tuple[Any, ...]:
    """The parameters of :meth:`HotSql.insert` for ``(request, epoch, attempts)``."""
    params: list[Any] = []
    for r, epoch, attempts in items:
        params += [r.task_id, r.task_name, RUNNING if r.starts_now else RESERVED, holder, epoch,
                   ttl, attempts, r.max_attempts, r.policy, r.retries, r.message.body,
                   dumps(r.message.headers), dumps(r.message.properties),
                   dumps(r.message.delivery_info), r.message.content_type,
                   r.message.content_encoding, r.publication, queue_of(r.message),
                   r.starts_now]
    return tuple(params)


def grants(rows: Any) -> dict[str, Grant]:
    """Grants from rows of :data:`GRANT_COLUMNS`."""
    return {task_id: Grant(task_id, int(epoch), token, float(lease_until), int(attempts),
                           state == RUNNING)
            for task_id, epoch, token, lease_until, attempts, state in rows}


def chunks(batch: list[tuple[int, ReserveRequest]], packet: int | None
           ) -> list[list[tuple[int, ReserveRequest]]]:
    """``batch`` in statements of at most ``CHUNK`` rows and, with big messages, of
    bodies adding up to at most ``packet`` bytes: over ``max_allowed_packet`` the server
    drops the connection, as an outage would."""
    if packet is None:
        return [batch[i:i + CHUNK] for i in range(0, len(batch), CHUNK)]
    out: list[list[tuple[int, ReserveRequest]]] = [[]]
    size = 0
    for item in batch:
        grows = len(item[1].message.body)
        if out[-1] and (size + grows > packet or len(out[-1]) >= CHUNK):
            out.append([])
            size = 0
        out[-1].append(item)
        size += grows
    return out
