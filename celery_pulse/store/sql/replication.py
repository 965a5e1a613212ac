"""At start, on PostgreSQL: warn when a standby is attached but commits do not wait for it.

pulse's promises (one holder per task, each beat slot once) hold across a failover only
if every commit pulse was told of survives it. With asynchronous replication a promoted
standby may lack the last commits: a claim granted and started on the old primary is
granted again on the new one, and the task runs twice. Synchronous replication
(``synchronous_standby_names`` set, ``synchronous_commit`` ``on``, ``remote_write`` or
``remote_apply``) or a managed service that promises no acknowledged commit is lost
avoids it (docs/production.md, "High availability").

Best effort: the check never stops a worker. A server without a streaming standby in
``pg_stat_replication`` (a single server, or a managed service that replicates its
storage instead) gets no warning.
"""

from __future__ import annotations

import dataclasses
import logging

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

logger = logging.getLogger(__name__)

#: Where the requirement is explained.
DOCS = "docs/production.md, \"High availability\""
#: ``synchronous_commit`` values under which a commit returns before any standby has it.
_LOCAL_ONLY = ("off", "local")


@dataclasses.dataclass(frozen=True)
class Replication:
    """What the primary says of its replication, as the store's role may read it."""

    synchronous_commit: str
    synchronous_standby_names: str
    #: Walsenders streaming to a physical standby (``pg_stat_replication``).
    standbys: int

    @property
    def synchronous(self) -> bool:
        """Whether a commit waits for a standby before it returns."""
        return (bool(self.synchronous_standby_names.strip())
                and self.synchronous_commit not in _LOCAL_ONLY)


def read_replication(conn: sa.Connection) -> Replication:
    """The settings and the attached standbys. ``pg_stat_replication`` is readable by
    every role (without ``pg_read_all_stats`` the details are NULL, the rows are
    there); a logical walsender (a CDC tool) has no standby behind it: not counted."""
    commit, names = conn.execute(sa.text(
        "SELECT current_setting('synchronous_commit'), "
        "current_setting('synchronous_standby_names')")).one()
    standbys = conn.execute(sa.text(
        "SELECT count(*) FROM pg_stat_replication r WHERE NOT EXISTS (SELECT 1 FROM "
        "pg_replication_slots s WHERE s.active_pid = r.pid AND s.slot_type = 'logical')"
    )).scalar_one()
    return Replication(str(commit), str(names), int(standbys))


def warning_for(rep: Replication) -> str | None:
    """The warning to log for ``rep``, or None when there is nothing to warn of."""
    if rep.standbys == 0 or rep.synchronous:
        return None
    return (f"pulse: the store's PostgreSQL has {rep.standbys} standby(s) attached but "
            f"commits do not wait for them (synchronous_commit={rep.synchronous_commit!r}, "
            f"synchronous_standby_names={rep.synchronous_standby_names!r}): after a "
            f"failover the new primary may lack commits pulse was told of, and a task "
            f"may run twice. Set synchronous_standby_names and synchronous_commit=on "
            f"(see {DOCS}).")


def check_replication(engine: sa.Engine) -> Replication | None:
    """Log :func:`warning_for` the store at ``engine`` (PostgreSQL only). Returns what
    was read, or None when it is not PostgreSQL or could not be read (logged, the
    worker starts anyway)."""
    if engine.dialect.name != "postgresql":
        return None
    try:
        with engine.connect() as conn:
            rep = read_replication(conn)
    except sa_exc.SQLAlchemyError as exc:
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0]
        logger.info("pulse: could not check the store's replication settings (%s); see %s",
                    first, DOCS)
        return None
    message = warning_for(rep)
    if message:
        logger.warning(message)
    return rep
