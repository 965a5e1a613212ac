"""Table definitions, once. Migrations are checked against these by the test suite.

Timestamps are store-clock seconds since the epoch as double precision: the same
arithmetic works on PostgreSQL, MySQL/MariaDB and SQLite, and nothing ever compares them with a
process clock.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_pulse.store.sql.types import BLOB, SECONDS, TABLE_OPTIONS, TEXT

metadata = sa.MetaData()

#: A claim's checkpoint columns (revision 0017), emptied when a new publication restarts
#: a finished task.
CHECKPOINT_COLUMNS = ("checkpoint", "checkpoint_epoch", "checkpoint_seq", "checkpoint_at")

#: The claims' indexes for the operators' filters, by name: each ends in ``(created_at,
#: task_id)``, the pages' order, so a filtered page is a range scan of one index.
VIEW_INDEXES: dict[str, tuple[str, ...]] = {
    "created": (), "state_created": ("state",), "queue_created": ("queue",),
    "name_created": ("task_name",), "holder_created": ("holder",)}

workers = sa.Table(
    "pulse_workers",
    metadata,
    sa.Column("worker_id", sa.String(255), primary_key=True),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("labels", TEXT, nullable=False),
    sa.Column("registered_at", SECONDS, nullable=False),
    sa.Column("last_heartbeat", SECONDS, nullable=False),
    sa.Column("expires_at", SECONDS, nullable=False),
    sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
    **TABLE_OPTIONS,
)

#: One row per Celery task id: who may run it (holder, token, epoch) until when
#: (``lease_until``, store clock), and the original message, byte-exact.
claims = sa.Table(
    "pulse_claims",
    metadata,
    sa.Column("task_id", sa.String(255), primary_key=True),
    sa.Column("task_name", sa.String(255), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("holder", sa.String(255)),
    sa.Column("token", sa.String(64)),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("lease_until", SECONDS),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("policy", sa.String(16), nullable=False),
    sa.Column("retries", sa.Integer, nullable=False),
    sa.Column("body", BLOB, nullable=False),
    sa.Column("headers", TEXT, nullable=False),
    sa.Column("properties", TEXT, nullable=False),
    sa.Column("delivery_info", TEXT, nullable=False),
    sa.Column("content_type", sa.String(128), nullable=False),
    sa.Column("content_encoding", sa.String(64), nullable=False),
    sa.Column("created_at", SECONDS, nullable=False),
    sa.Column("reserved_at", SECONDS),
    sa.Column("started_at", SECONDS),
    sa.Column("finished_at", SECONDS),
    sa.Column("outcome", sa.String(32)),
    sa.Column("error", TEXT),
    #: Identity of the publication the claim belongs to (``pulse_pub`` header; NULL for
    #: messages published without it): a redelivery vs a new publication of the task id.
    sa.Column("publication", sa.String(64)),
    #: The delivery's routing key, kept at reservation for the operators' filter (NULL on
    #: claims reserved before revision 0011).
    sa.Column("queue", sa.String(255)),
    #: The latest checkpoint (JSON), the attempt and the write of it that made it, and
    #: when by the store clock (revision 0017; :mod:`celery_pulse.store.checkpoints`).
    sa.Column("checkpoint", TEXT),
    sa.Column("checkpoint_epoch", sa.BigInteger),
    sa.Column("checkpoint_seq", sa.BigInteger),
    sa.Column("checkpoint_at", SECONDS),
    # The operators' pages (newest first under one filter): each filter walks its own
    # index in ``created_at`` order and stops after one page (revision 0011).
    *[sa.Index(f"ix_pulse_claims_{name}", *columns, "created_at", "task_id")
      for name, columns in VIEW_INDEXES.items()],
    # Partial: Recover's scan only looks at claims under a lease, the purge at finished
    # ones, and rows outside an index's predicate cost it nothing when updated. (Strict
    # comparisons on the column imply IS NOT NULL, also in generic plans.)
    sa.Index("ix_pulse_claims_lease", "lease_until",
             postgresql_where=sa.text("lease_until IS NOT NULL"),
             sqlite_where=sa.text("lease_until IS NOT NULL")),
    sa.Index("ix_pulse_claims_finished", "finished_at",
             postgresql_where=sa.text("finished_at IS NOT NULL"),
             sqlite_where=sa.text("finished_at IS NOT NULL")),
    **TABLE_OPTIONS,
)

#: Late outcomes from stale holders: kept, never authoritative (seed 003 EVIDENCE_ONLY).
evidence = sa.Table(
    "pulse_evidence",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
              autoincrement=True),
    sa.Column("task_id", sa.String(255), nullable=False, index=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("holder", sa.String(255), nullable=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("error", TEXT),
    sa.Column("recorded_at", SECONDS, nullable=False),
    #: What the stale attempt returned, as Celery shows it (None: a failure, or unknown).
    sa.Column("result", TEXT),
    **TABLE_OPTIONS,
)

#: Human decisions on needs-review tasks (who decided what, when): the audit trail.
reviews = sa.Table(
    "pulse_reviews",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
              autoincrement=True),
    sa.Column("task_id", sa.String(255), nullable=False, index=True),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("outcome", sa.String(32)),
    sa.Column("note", TEXT),
    sa.Column("decided_by", sa.String(255), nullable=False),
    sa.Column("decided_at", SECONDS, nullable=False),
    **TABLE_OPTIONS,
)

#: One row per election key: the current term (epoch) and its holder's lease.
leaders = sa.Table(
    "pulse_leaders",
    metadata,
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("holder", sa.String(255), nullable=False),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("lease_until", SECONDS, nullable=False),
    sa.Column("acquired_at", SECONDS, nullable=False),
    **TABLE_OPTIONS,
)

#: Each periodic slot ``(entry, due_at)`` exists once: inserted only by the current
#: leader (fenced by its epoch), published with a task id derived from the slot.
beat_slots = sa.Table(
    "pulse_beat_slots",
    metadata,
    sa.Column("entry", sa.String(255), primary_key=True),
    sa.Column("due_at", SECONDS, primary_key=True),
    sa.Column("task_id", sa.String(255), nullable=False),
    sa.Column("task", sa.String(255), nullable=False),
    sa.Column("payload", TEXT, nullable=False),
    sa.Column("leader_epoch", sa.BigInteger, nullable=False),
    sa.Column("created_at", SECONDS, nullable=False),
    sa.Column("published_at", SECONDS),
    sa.Index("ix_pulse_beat_slots_unpublished", "published_at"),
    **TABLE_OPTIONS,
)

#: ``last_run_at`` per entry (the due time of its latest slot): survives restarts.
beat_state = sa.Table(
    "pulse_beat_state",
    metadata,
    sa.Column("entry", sa.String(255), primary_key=True),
    sa.Column("last_run_at", SECONDS, nullable=False),
    **TABLE_OPTIONS,
)

#: Dynamic schedule entries (``celery pulse schedule add``), beside ``beat_schedule``.
schedule = sa.Table(
    "pulse_schedule",
    metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("task", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("spec", TEXT, nullable=False),
    sa.Column("args", TEXT, nullable=False),
    sa.Column("kwargs", TEXT, nullable=False),
    sa.Column("options", TEXT, nullable=False),
    sa.Column("enabled", sa.Boolean, nullable=False),
    sa.Column("updated_at", SECONDS, nullable=False),
    **TABLE_OPTIONS,
)

#: Persistent drain requests: a drained name stays drained across restarts until undrain.
drains = sa.Table(
    "pulse_drains",
    metadata,
    sa.Column("worker_id", sa.String(255), primary_key=True),
    sa.Column("requested_by", sa.String(255), nullable=False),
    sa.Column("requested_at", SECONDS, nullable=False),
    **TABLE_OPTIONS,
)

#: The ``pulse://`` result backend: Celery's keys (task meta, saved groups, chord
#: counters) and their values. ``state`` is a task meta's Celery state, so that "a
#: success is final" is decided by the upsert itself, not by a read before it.
results = sa.Table(
    "pulse_results",
    metadata,
    sa.Column("key", sa.String(512), primary_key=True),
    sa.Column("value", BLOB),
    sa.Column("counter", sa.BigInteger),
    sa.Column("state", sa.String(32)),
    sa.Column("updated_at", SECONDS, nullable=False),
    sa.Column("expires_at", SECONDS),
    sa.Index("ix_pulse_results_expires", "expires_at",
             postgresql_where=sa.text("expires_at IS NOT NULL"),
             sqlite_where=sa.text("expires_at IS NOT NULL")),
    **TABLE_OPTIONS,
)

#: Cluster-wide concurrency limits seen by a start: the row a start locks to count the
#: key's holders (``max_running`` is the limit the latest start asked for).
permits = sa.Table(
    "pulse_permits",
    metadata,
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("max_running", sa.Integer, nullable=False),
    sa.Column("updated_at", SECONDS, nullable=False),
    #: Revision 0016: a rate's window (seconds); None: a concurrency limit.
    sa.Column("window_s", SECONDS),
    #: Revision 0018: a rate key's upper bound on its recent starts (two fixed buckets
    #: of ``bucket_s`` seconds), trusted while ``bounded_at = updated_at``
    #: (:mod:`celery_pulse.store.rate_bound`).
    sa.Column("bounded_at", SECONDS),
    sa.Column("bucket_s", SECONDS),
    sa.Column("bucket_no", sa.BigInteger),
    sa.Column("bucket_starts", sa.Integer),
    sa.Column("prev_starts", sa.Integer),
    **TABLE_OPTIONS,
)

#: Which claim asked for which permit, under which epoch. A ``held`` row holds its
#: permit while its claim is ``running`` under that epoch: every statement that moves a
#: claim on gives the permit back by itself, so a permit is never given back twice. A
#: row not held says the claim, ``reserved`` under that epoch, waits for the key (shown,
#: never counted). Held rows of past epochs are dropped by the next start of their key,
#: every past row by retention.
permit_holds = sa.Table(
    "pulse_permit_holds",
    metadata,
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("task_id", sa.String(255), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("held", sa.Boolean, nullable=False),
    sa.Index("ix_pulse_permit_holds_task", "task_id"),
    **TABLE_OPTIONS,
)

#: Gateway credentials (:mod:`celery_pulse.gateway.credentials`): the digest of each
#: secret, never the secret; ``scopes`` and ``queues`` as JSON lists. A revoked row is
#: kept (who revoked it, when) and keeps its name.
credentials = sa.Table(
    "pulse_credentials",
    metadata,
    sa.Column("credential_id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("secret_digest", sa.String(64), nullable=False),
    sa.Column("scopes", TEXT, nullable=False),
    sa.Column("queues", TEXT, nullable=False),
    sa.Column("created_at", SECONDS, nullable=False),
    sa.Column("created_by", sa.String(255), nullable=False),
    sa.Column("revoked_at", SECONDS),
    sa.Column("revoked_by", sa.String(255)),
    #: Revision 0015: when it stops authenticating (None: never), and its rotation: the
    #: secret it had before, accepted until ``previous_until`` (two live secrets).
    sa.Column("expires_at", SECONDS),
    sa.Column("previous_digest", sa.String(64)),
    sa.Column("previous_until", SECONDS),
    sa.Column("rotated_at", SECONDS),
    sa.Column("rotated_by", sa.String(255)),
    sa.Index("ux_pulse_credentials_name", "name", unique=True),
    **TABLE_OPTIONS,
)

#: Gateway worker instances and their owner: the credential and the instance secret's
#: digest that first said hello for the id (``seen_at``: its latest hello).
gateway_instances = sa.Table(
    "pulse_gateway_instances",
    metadata,
    sa.Column("instance_id", sa.String(32), primary_key=True),
    sa.Column("credential_id", sa.String(32), nullable=False),
    sa.Column("secret_digest", sa.String(64), nullable=False),
    sa.Column("created_at", SECONDS, nullable=False),
    sa.Column("seen_at", SECONDS, nullable=False),
    #: Its sessions (revision 0014): the current generation, which session and gateway
    #: hold it, what every reconnect must present again (queue and capabilities, as a
    #: digest) and its declared capacity, so that any gateway process resumes it.
    sa.Column("generation", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("session_id", sa.String(32)),
    sa.Column("gateway", sa.String(255)),
    sa.Column("identity_digest", sa.String(64)),
    sa.Column("capacity_sequence", sa.BigInteger, nullable=False, server_default="-1"),
    sa.Column("capacity", sa.Integer, nullable=False, server_default="0"),
    sa.Column("drain", sa.Boolean, nullable=False, server_default=sa.false()),
    **TABLE_OPTIONS,
)

#: The grants a gateway assigned to its instances (``task.assign``), by attempt id: what
#: any gateway process needs to answer a frame naming one. The secret is the claim's
#: token, kept here only as a digest.
gateway_attempts = sa.Table(
    "pulse_gateway_attempts",
    metadata,
    sa.Column("attempt_id", sa.String(32), primary_key=True),
    sa.Column("instance_id", sa.String(32), nullable=False),
    sa.Column("task_id", sa.String(255), nullable=False),
    sa.Column("wire_task_id", sa.String(32), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("token_digest", sa.String(64), nullable=False),
    sa.Column("task_name", sa.String(255), nullable=False),
    sa.Column("created_at", SECONDS, nullable=False),
    sa.Index("ix_pulse_gateway_attempts_instance", "instance_id", "created_at"),
    sa.Index("ix_pulse_gateway_attempts_created", "created_at"),
    sa.Index("ix_pulse_gateway_attempts_task", "task_id"),
    **TABLE_OPTIONS,
)

#: Starts granted under a rate limit (revision 0016), one row per key a start took: a
#: rate's window counts its key's rows newer than the window. Rows past the longest
#: window of their key are deleted by the next start of it, and by retention.
rate_starts = sa.Table(
    "pulse_rate_starts",
    metadata,
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("task_id", sa.String(255), primary_key=True),
    sa.Column("epoch", sa.BigInteger, primary_key=True),
    sa.Column("started_at", SECONDS, nullable=False),
    sa.Index("ix_pulse_rate_starts_key", "key", "started_at"),
    **TABLE_OPTIONS,
)
