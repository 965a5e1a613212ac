"""A primary and a streaming standby with synchronous replication, both private
PostgreSQL servers on free ports: a failover a test causes (kill the primary, promote
the standby) and a multi-host store URL over both."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import sqlalchemy as sa

from celery_pulse.testing import wait_for
from tests.helpers.pg import PrivatePostgres, pg_bin

#: The standby's name, as the primary's ``synchronous_standby_names`` lists it (the
#: walreceiver's ``application_name`` is its ``cluster_name``).
STANDBY_NAME = "pulse_standby"


class ReplicatedPostgres:
    """``primary`` streams to ``standby``; a commit returns once the standby has it.

    Durable enough for a failover (``synchronous_commit=on``: an acknowledged commit is
    on the standby), fast otherwise (no fsync: the host never crashes in a test).
    """

    def __init__(self, synchronous: bool = True) -> None:
        sync = {"synchronous_standby_names": STANDBY_NAME,
                "synchronous_commit": "on"} if synchronous else {}
        self.primary = PrivatePostgres({**PrivatePostgres.FAST, **sync,
                                        "wal_level": "replica", "max_wal_senders": "5"})
        self.standby = PrivatePostgres({**PrivatePostgres.FAST, "cluster_name": STANDBY_NAME,
                                        "hot_standby": "on"})

    @property
    def url(self) -> str:
        """Both servers, whichever is read-write (libpq's ``target_session_attrs``)."""
        return (f"postgresql+psycopg://postgres@/postgres?host=127.0.0.1,127.0.0.1"
                f"&port={self.primary.port},{self.standby.port}"
                f"&target_session_attrs=read-write")

    def start(self) -> ReplicatedPostgres:
        self.primary.init()
        # -R: standby.signal and primary_conninfo; -X stream: WAL during the copy too.
        self.standby.run(pg_bin("pg_basebackup"), "-D", self.standby.data, "-R",
                          "-X", "stream", "-c", "fast", "-h", "127.0.0.1",
                          "-p", str(self.primary.port), "-U", "postgres")
        self.standby.start()
        wait_for(self.streaming, 30, "the standby to stream from the primary")
        return self

    def streaming(self) -> bool:
        """Whether the primary sees the standby attached, synchronous or not."""
        engine = sa.create_engine(self.primary.url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                return bool(conn.execute(sa.text(
                    "select count(*) from pg_stat_replication where application_name = :n "
                    "and state = 'streaming'"), {"n": STANDBY_NAME}).scalar())
        finally:
            engine.dispose()

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every process of it (a host gone): no
        shutdown, no last word to the clients, every socket closed at once. Its
        children each run in a session of their own, so they are found by parent."""
        pid = self.primary.postmaster_pid()
        children = _children(pid)  # before the kill: orphans are adopted by init
        for victim in (pid, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)

    def demote_primary(self) -> None:
        """The primary stays up but takes no more writes (``default_transaction_read_only``
        for every session, as a fencing tool may leave a demoted primary)."""
        engine = sa.create_engine(self.primary.url, poolclass=sa.pool.NullPool,
                                  isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("alter system set default_transaction_read_only = on"))
                conn.execute(sa.text("select pg_reload_conf()"))

            def applied() -> bool:  # the postmaster reloaded, and signalled its children
                with engine.connect() as conn:
                    return bool(conn.execute(sa.text(
                        "select current_setting('default_transaction_read_only') = 'on'"
                    )).scalar())
            wait_for(applied, 10, "the primary to turn read-only")
        finally:
            engine.dispose()

    def promote(self) -> None:
        """The standby becomes the read-write primary (``pg_ctl promote``, waited for)."""
        self.standby.run(pg_bin("pg_ctl"), "-D", self.standby.data, "-w", "-t", "30",
                          "promote")

    def destroy(self) -> None:
        for server in (self.standby, self.primary):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                server.destroy()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry))
    return found
