"""A one-minute story of what pulse does, on the embedded default (no servers).

    python -m example_project.demo

Starts three real ``celery worker -P pulse`` processes in a temporary folder (SQLite
store, ``filesystem://`` broker), submits a payment and a long report, SIGKILLs one
worker, SIGSTOPs another, and narrates what the store and the worker logs say:
registry expiry, takeover by Recover under a new epoch, the review queue,
re-dispatch, ``LeaseLost`` in the paused worker's task, and leader failover of the
beat. Ends with ``celery -A example_project pulse status``.

Every wait is bounded and every process is killed on the way out; the exit code is
0 when the whole story was observed, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
APP = "example_project"
#: The settings PULSE_DEMO_FAST selects in example_project/app.py.
WORKER_TTL = LEASE_TTL = LEADER_TTL = 3.0
#: Hard limit for the whole run: the demo never hangs, whatever happens.
RUN_LIMIT = 150.0
POLL = 0.2


class DemoFailed(Exception):
    """Something the story needs did not happen in time."""


# -- output ---------------------------------------------------------------------------------
class Display:
    """Narration lines, plus a live status line at the bottom when stdout is a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty() and os.environ.get("TERM") != "dumb"
        self.color = self.tty and not os.environ.get("NO_COLOR")
        self.started = time.monotonic()
        self._status = ""

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _style(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def _clear(self) -> None:
        if self.tty and self._status:
            self.out.write("\r\033[K")

    def _redraw(self) -> None:
        if self.tty and self._status:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.out.write(self._style(self._status[:width], "2"))
        self.out.flush()

    def say(self, text: str, *, bold: bool = False) -> None:
        self._clear()
        stamp = self._style(f"[{self.elapsed:5.1f}s]", "36")
        self.out.write(f"{stamp} {self._style(text, '1') if bold else text}\n")
        self._redraw()

    def stage(self, title: str) -> None:
        self._clear()
        self.out.write("\n" + self._style(f"== {title}", "1;33") + "\n")
        self._redraw()

    def block(self, text: str) -> None:
        self._clear()
        for line in text.rstrip().splitlines():
            self.out.write(f"    {line}\n")
        self._redraw()

    def status(self, line: str) -> None:
        if not self.tty:
            return
        self._clear()
        self._status = line
        self._redraw()

    def close(self) -> None:
        self._clear()
        self._status = ""
        self.out.flush()


# -- processes ------------------------------------------------------------------------------
class Cluster:
    """The worker processes of the demo; each in its own process group."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.paused: set[str] = set()
        self.killed: set[str] = set()

    def celery(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "celery", "-A", APP, *args],
                              env=self.env, cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def start(self, name: str, concurrency: int = 3) -> None:
        self.logs[name] = self.folder / f"{name}.log"
        with open(self.logs[name], "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "pulse",
                 "-n", f"{name}@demo", "-c", str(concurrency), "-l", "info",
                 "--without-mingle", "--without-gossip"],
                env=self.env, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

    def _group(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def kill(self, name: str) -> None:
        """SIGKILL the worker and its pool children: no goodbye, like a lost machine."""
        self._group(name, signal.SIGKILL)
        self.killed.add(name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[name].wait(10)

    def pause(self, name: str) -> None:
        """SIGSTOP the worker and its pool children: a long GC pause, a frozen VM."""
        self._group(name, signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        self._group(name, signal.SIGCONT)
        self.paused.discard(name)

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            self.procs[name] = proc


# -- what the store and the logs say -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fact:
    """One thing observed, from a worker's log (``worker``) or the store (``worker=''``)."""

    kind: str
    worker: str
    task_id: str = ""
    epoch: int = 0
    detail: str = ""
    at: float = 0.0


LOG_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("lease-lost", re.compile(r"pulse: lease lost for task (?P<task>\S+) epoch (?P<epoch>\d+) "
                              r"\((?P<detail>.*), was \w+\)")),
    ("task-leaselost", re.compile(r"pulse: task \S+\[(?P<task>[^\]]+)\] lost its lease: was held")),
    ("recovered", re.compile(r"pulse: recovered \S+\[(?P<task>[^\]]+)\] \(was \w+\): "
                             r"(?P<detail>re-dispatched as epoch (?P<epoch>\d+)|.*)")),
    ("leader", re.compile(r"pulse: \S+ is now the leader of beat \(epoch (?P<epoch>\d+)\)")),
    ("reregistered", re.compile(r"pulse: re-registered \S+ under a new token")),
    ("fenced", re.compile(r"pulse: \S+ fenced \((?P<detail>[^)]*)\)")),
    ("duplicate", re.compile(r"pulse: duplicate delivery of \S+\[(?P<task>[^\]]+)\] dropped: "
                             r"(?P<detail>.*)")),
    ("succeeded", re.compile(r"Task \S+\[(?P<task>[^\]]+)\] succeeded in")),
    ("report-start", re.compile(r"build_report\[(?P<task>[^\]]+)\]: report \S+: starting on "
                                r"\S+ \(epoch (?P<epoch>\d+)\)")),
    ("report-stop", re.compile(r"report \S+: lease lost after (?P<detail>\d+/\d+) sections")),
]


@dataclasses.dataclass
class Snapshot:
    workers: dict[str, bool]
    leader: tuple[str, int] | None
    claims: dict[str, Any]
    needs_review: list[str]
    ledger: list[Any]
    reports: list[Any]


def short(worker_id: str | None) -> str:
    return (worker_id or "-").split("@")[0]


class Observer:
    """Reads the store (by its own clock) and the new lines of each worker's log."""

    def __init__(self, store_url: str, cluster: Cluster, labels: dict[str, str]) -> None:
        import sqlalchemy as sa

        from celery_pulse.store.sql import open_store
        from example_project.schema import make_engine

        self.sa = sa
        self.store = open_store(store_url)
        self.engine = make_engine(store_url)
        self.cluster = cluster
        self.labels = labels
        self.facts: list[Fact] = []
        self._offsets: dict[str, int] = {}
        self.last = Snapshot({}, None, {}, [], [], [])

    def close(self) -> None:
        self.store.close()
        self.engine.dispose()

    def snapshot(self) -> Snapshot:
        from celery_pulse.bootsteps.runtime import BEAT_KEY
        from example_project.schema import ledger, reports

        workers = {short(w.worker_id): w.alive for w in self.store.list_workers()}
        info = self.store.get_leader(BEAT_KEY)
        leader = (short(info.holder), info.epoch) if info is not None and info.alive else None
        claims = {c.task_id: c for c in self.store.list_claims(None, limit=500)
                  if c.task_id in self.labels}
        review = [item.task_id for item in self.store.list_review()]
        with self.engine.connect() as conn:
            ledger_rows = list(conn.execute(self.sa.select(ledger)))
            report_rows = list(conn.execute(self.sa.select(reports)))
        self.last = Snapshot(workers, leader, claims, review, ledger_rows, report_rows)
        return self.last

    def read_logs(self) -> list[Fact]:
        new: list[Fact] = []
        for name, path in self.cluster.logs.items():
            if not path.exists():
                continue
            with open(path, "rb") as fh:
                fh.seek(self._offsets.get(name, 0))
                data = fh.read()
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[name] = self._offsets.get(name, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                for kind, pattern in LOG_PATTERNS:
                    m = pattern.search(line)
                    if m is None:
                        continue
                    groups = m.groupdict()
                    new.append(Fact(kind, name, groups.get("task") or "",
                                    int(groups.get("epoch") or 0), groups.get("detail") or "",
                                    time.monotonic()))
                    break
        self.facts.extend(new)
        return new

    def seen(self, kind: str, **match: Any) -> Fact | None:
        for fact in self.facts:
            if fact.kind == kind and all(getattr(fact, k) == v for k, v in match.items()):
                return fact
        return None


# -- the story ------------------------------------------------------------------------------
class Demo:
    def __init__(self, folder: Path, display: Display) -> None:
        self.folder = folder
        self.show = display
        self.env = dict(os.environ, PULSE_EXAMPLE_DIR=str(folder / ".celery-pulse"),
                        PULSE_DEMO_FAST="1", PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join(
                            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        # Never talk to a production store or broker by accident.
        self.env.pop("PULSE_STORE_URL", None)
        self.env.pop("PULSE_BROKER_URL", None)
        self.cluster = Cluster(folder, self.env)
        self.labels: dict[str, str] = {}
        self.observer: Observer | None = None
        self.client: Any = None
        self.times: dict[str, float] = {}
        self._prev: Snapshot | None = None

    # -- polling and narration ------------------------------------------------------------
    def label(self, task_id: str) -> str:
        return self.labels.get(task_id, "a sync_rates run")

    def poll(self) -> Snapshot:
        assert self.observer is not None
        if self.show.elapsed > RUN_LIMIT:
            raise DemoFailed(f"the demo ran longer than {RUN_LIMIT:.0f}s")
        for fact in self.observer.read_logs():
            self.narrate_fact(fact)
        snap = self.observer.snapshot()
        self.narrate_changes(self._prev, snap)
        self._prev = snap
        self.show.status(self.status_line(snap))
        return snap

    def narrate_fact(self, fact: Fact) -> None:
        w, what = fact.worker, self.label(fact.task_id)
        tracked = fact.task_id in self.labels
        if fact.kind == "lease-lost" and tracked:
            self.show.say(f"{w}: lease on {what} (epoch {fact.epoch}) is gone: {fact.detail}")
        elif fact.kind == "task-leaselost" and tracked:
            self.show.say(f"{w}: LeaseLost raised inside {what}: the stale copy stops before "
                          f"writing anything", bold=True)
        elif fact.kind == "recovered" and tracked:
            verdict = fact.detail
            if fact.epoch:
                verdict = (f"took it over as epoch {fact.epoch} and re-published it "
                           f"(acks_late: safe to run again)")
            elif "needs review" in verdict:
                verdict = ("took it over and sent it to REVIEW: it was mid-call, so nobody "
                           "knows whether the card was charged; pulse won't run it again")
            self.show.say(f"{w}: Recover {verdict} [{what}]", bold=True)
        elif fact.kind == "recovered":
            self.show.say(f"{w}: Recover re-dispatched {what} the dead worker had reserved")
        elif fact.kind == "leader":
            self.show.say(f"{w} is now the beat leader (epoch {fact.epoch}): only it fires "
                          f"sync_rates", bold=fact.epoch > 1)
        elif fact.kind == "reregistered":
            self.show.say(f"{w}: woke up, found its registration expired, self-fenced its "
                          f"leases and re-registered under a new token")
        elif fact.kind == "fenced":
            self.show.say(f"{w}: fenced ({fact.detail}): takes no new work until registered")
        elif fact.kind == "duplicate" and tracked:
            self.show.say(f"{w}: dropped a duplicate delivery of {what} ({fact.detail})")
        elif fact.kind == "succeeded" and tracked:
            self.show.say(f"{w}: {what} succeeded")

    def narrate_changes(self, prev: Snapshot | None, snap: Snapshot) -> None:
        before = prev.workers if prev else {}
        for name, alive in snap.workers.items():
            was = before.get(name)
            if alive and was is None:
                self.show.say(f"{name} registered (its token is minted by the store)")
            elif was and not alive:
                self.show.say(f"registry: {name}'s registration EXPIRED by the store clock "
                              f"(no heartbeat for pulse_worker_ttl={WORKER_TTL:g}s)", bold=True)
        for task_id, claim in snap.claims.items():
            old = prev.claims.get(task_id) if prev else None
            key = (claim.state, claim.holder, claim.epoch)
            if old is not None and (old.state, old.holder, old.epoch) == key:
                continue
            where = f" on {short(claim.holder)}" if claim.state in ("reserved", "running") else ""
            self.show.say(f"store: {self.label(task_id)} is {claim.state}{where} "
                          f"(epoch {claim.epoch}, attempt {claim.attempts})")

    def status_line(self, snap: Snapshot) -> str:
        def worker_state(name: str) -> str:
            if name in self.cluster.paused:
                return "paused"
            if name in self.cluster.killed:
                return "killed" if snap.workers.get(name) else "dead"
            return {True: "up", False: "expired", None: "starting"}[snap.workers.get(name)]
        workers = " ".join(f"{n}:{worker_state(n)}" for n in self.cluster.procs)
        leader = f"{snap.leader[0]}#{snap.leader[1]}" if snap.leader else "none"
        claims = " ".join(f"{self.label(t).split()[0]}:{c.state}#{c.epoch}"
                          for t, c in snap.claims.items())
        return (f"[{self.show.elapsed:5.1f}s] {workers} | leader {leader} | {claims} | "
                f"ledger {len(snap.ledger)}")

    def wait(self, what: str, predicate: Callable[[Snapshot], Any], timeout: float) -> Any:
        """Poll until ``predicate(snapshot)`` is truthy; DemoFailed after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self.poll())
            if value:
                return value
            if time.monotonic() > deadline:
                raise DemoFailed(f"did not see {what} within {timeout:g}s")
            time.sleep(POLL)

    def seen(self, kind: str, **match: Any) -> Fact | None:
        assert self.observer is not None
        return self.observer.seen(kind, **match)

    # -- stages ---------------------------------------------------------------------------
    def run(self) -> None:
        show, cluster = self.show, self.cluster
        show.stage("1. one worker, a payment and a report")
        show.say("celery -A example_project pulse migrate")
        migrated = cluster.celery("pulse", "migrate")
        if migrated.returncode != 0:
            raise DemoFailed(f"pulse migrate failed:\n{migrated.stderr}")
        show.block(migrated.stdout)
        # The demo talks to its own folder: a producer like any web front-end would use,
        # sending the example's tasks by name.
        from celery import Celery

        from example_project.app import atomic_filesystem_puts, embedded_broker, embedded_store_url
        from example_project.schema import ensure_schema

        here = self.env["PULSE_EXAMPLE_DIR"]
        store_url = embedded_store_url(here)
        broker_url, options = embedded_broker(here, fast=True)
        atomic_filesystem_puts()
        self.client = Celery("demo-client", broker=broker_url)
        self.client.conf.broker_transport_options = options
        ensure_schema(store_url)
        self.observer = Observer(store_url, cluster, self.labels)

        launched = time.monotonic()
        cluster.start("alpha")
        show.say("started worker alpha: celery -A example_project worker -P pulse -c 3")
        self.wait("alpha registered and leading the beat",
                  lambda s: s.workers.get("alpha") and s.leader and s.leader[0] == "alpha", 40)
        # Both tasks must still run on alpha once bravo and charlie are up (two workers
        # starting at once take about 1.5 times alpha's start): on a loaded machine, where
        # a start takes longer, they run longer too (a CPU-bound run caught the payment
        # done before the kill).
        stretch = max(1.0, 2.5 * (time.monotonic() - launched) / 6.0)

        payment_id, report_id = str(uuid.uuid4()), str(uuid.uuid4())
        self.labels[payment_id] = "payment order-1001"
        self.labels[report_id] = "report q3-revenue"
        send = self.client.send_task
        send("example_project.tasks.charge", ("order-1001", 2500),
             {"provider_seconds": 6.0 * stretch}, task_id=payment_id)
        send("example_project.tasks.build_report", ("q3-revenue",),
             {"sections": 16, "seconds_per_section": 0.5 * stretch}, task_id=report_id)
        show.say("submitted charge(order-1001) [acks_late=False: must not run twice] and "
                 f"build_report(q3-revenue) [acks_late=True: {8 * stretch:.0f}s of work]")

        def both_running_on_alpha(s: Snapshot) -> bool:
            return all(t in s.claims and s.claims[t].state == "running"
                       and short(s.claims[t].holder) == "alpha" for t in (payment_id, report_id))
        self.wait("both tasks running on alpha", both_running_on_alpha, 20)

        show.stage("2. two more workers")
        cluster.start("bravo")
        cluster.start("charlie")
        show.say("started bravo and charlie")
        self.wait("bravo and charlie registered",
                  lambda s: s.workers.get("bravo") and s.workers.get("charlie"), 40)

        show.stage("3. SIGKILL alpha (mid-payment, mid-report, beat leader)")
        cluster.kill("alpha")
        killed = time.monotonic()
        show.say("kill -9 alpha and its pool: no goodbye, no acknowledgement, nothing", bold=True)

        def after_kill(s: Snapshot) -> bool:
            rep = s.claims.get(report_id)
            for key, done in (("registry expiry", s.workers.get("alpha") is False),
                              ("payment in review", payment_id in s.needs_review),
                              ("report restarted", rep is not None and rep.state == "running"
                               and short(rep.holder) in ("bravo", "charlie")),
                              ("leader failover", s.leader is not None
                               and s.leader[0] in ("bravo", "charlie"))):
                if done and key not in self.times:
                    self.times[key] = time.monotonic() - killed
            return len(self.times) >= 4
        self.wait("alpha's work taken over and a new beat leader", after_kill,
                  WORKER_TTL + LEASE_TTL + LEADER_TTL + 15)

        snap = self.poll()
        runner = short(snap.claims[report_id].holder)
        spare = "charlie" if runner == "bravo" else "bravo"
        stale_epoch = snap.claims[report_id].epoch
        # Pause it once the report's own code runs (its first log line), not in the
        # moment between the start being authorised and the body being entered.
        self.wait(f"the report's body running on {runner}",
                  lambda s: self.seen("report-start", worker=runner, task_id=report_id,
                                      epoch=stale_epoch), 10)

        show.stage(f"4. SIGSTOP {runner} while it runs the report (a 'GC pause')")
        self.pause_until_taken_over(runner, report_id, stale_epoch)
        show.say(f"{spare} runs the report now; {runner} is still frozen mid-report, "
                 f"convinced it holds epoch {stale_epoch}")
        cluster.resume(runner)
        resumed = time.monotonic()
        show.say(f"SIGCONT {runner}", bold=True)
        self.wait(f"LeaseLost inside {runner}'s stale copy of the report",
                  lambda s: self.seen("task-leaselost", worker=runner, task_id=report_id), 15)
        self.times["resume -> LeaseLost"] = time.monotonic() - resumed
        self.wait(f"{runner} registered again", lambda s: s.workers.get(runner), 15)

        show.stage("5. the review queue: a human decides about the payment")
        listed = cluster.celery("pulse", "review")
        show.say("celery -A example_project pulse review")
        show.block(listed.stdout or listed.stderr)
        snap = self.poll()
        charged = [r for r in snap.ledger if r.order_id == "order-1001"]
        show.say(f"the ledger has {len(charged)} row(s) for order-1001 and the provider "
                 f"(idempotency key order-1001) shows no charge: retry it")
        retried = cluster.celery("pulse", "review", "retry", payment_id, "--note",
                                 "provider shows no charge for order-1001")
        show.say(f"celery -A example_project pulse review retry {payment_id[:8]}...")
        show.block(retried.stdout or retried.stderr)
        if retried.returncode != 0:
            raise DemoFailed("pulse review retry failed")

        show.stage("6. everything finishes, once")
        self.wait("the payment in the ledger",
                  lambda s: any(r.order_id == "order-1001" for r in s.ledger),
                  24 + 6 * stretch)
        self.wait("the report written", lambda s: any(r.name == "q3-revenue" for r in s.reports),
                  30)
        snap = self.poll()
        for row in snap.ledger:
            show.say(f"ledger: {row.order_id} {row.amount_cents / 100:.2f} charged by "
                     f"{short(row.worker)} under fencing token (task, epoch {row.epoch})")
        for row in snap.reports:
            show.say(f"report: {row.name} written by {short(row.worker)} under epoch "
                     f"{row.epoch}; the stale epoch-{stale_epoch} copy wrote nothing")
        self.summarise()

    def pause_until_taken_over(self, runner: str, report_id: str, stale_epoch: int) -> None:
        """SIGSTOP ``runner`` until another worker holds the report under a newer epoch.

        On SQLite a process frozen inside a write transaction holds the file's write
        lock, and every other process waits for it: then nothing can be taken over.
        If that (rare) case shows up, thaw it for a moment and freeze it again.
        """
        for attempt in range(3):
            self.cluster.pause(runner)
            paused = time.monotonic()
            self.show.say(f"kill -STOP {runner}: its heartbeats and lease renewals stop; "
                          f"its task is frozen mid-flight", bold=attempt == 0)
            try:
                self.wait("the report taken over from the paused worker",
                          lambda s: (c := s.claims.get(report_id)) is not None
                          and c.epoch > stale_epoch and short(c.holder) != runner
                          and c.state == "running", WORKER_TTL + LEASE_TTL + 8)
            except DemoFailed:
                self.cluster.resume(runner)
                self.show.say(f"no takeover yet ({runner} may have been frozen holding the "
                              f"SQLite write lock): thawing it and trying again")
                time.sleep(1.0)
                continue
            self.times["pause -> report taken over"] = time.monotonic() - paused
            return
        raise DemoFailed("the paused worker's report was never taken over")

    def summarise(self) -> None:
        import sqlalchemy as sa

        from celery_pulse.store.sql.tables import beat_slots

        assert self.observer is not None
        with self.observer.engine.connect() as conn:
            slots = conn.execute(sa.select(beat_slots.c.leader_epoch, sa.func.count())
                                 .group_by(beat_slots.c.leader_epoch)).all()
        per_leader = ", ".join(f"epoch {e}: {n}" for e, n in slots)
        self.show.say(f"beat: sync_rates slots fired per leader term: {per_leader} "
                      f"(each (entry, due_at) slot is a unique row: none fired twice)")
        self.show.stage("timings (lease/worker/leader TTL 3s, recover every 0.5s)")
        for key in ("registry expiry", "payment in review", "report restarted",
                    "leader failover"):
            self.show.say(f"SIGKILL -> {key}: {self.times[key]:.1f}s")
        for key in ("pause -> report taken over", "resume -> LeaseLost"):
            self.show.say(f"{key}: {self.times[key]:.1f}s")

    def final_status(self) -> None:
        self.show.stage("celery -A example_project pulse status")
        out = self.cluster.celery("pulse", "status")
        self.show.block(out.stdout or out.stderr)

    def tail_logs(self, lines: int = 15) -> None:
        for name, path in self.cluster.logs.items():
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                self.show.say(f"last lines of {name}'s log:")
                self.show.block("\n".join(tail))


@contextlib.contextmanager
def demo_folder() -> Iterator[Path]:
    keep = os.environ.get("PULSE_DEMO_KEEP")  # a folder to keep the logs in (debugging)
    if keep:
        path = Path(keep)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="pulse-demo-") as tmp:
        yield Path(tmp)


def main() -> int:
    display = Display(sys.stdout)
    code = 0
    with demo_folder() as folder:
        demo = Demo(folder, display)
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            display.say("celery-pulse demo: 3 workers, SQLite store, filesystem broker, "
                        f"in {folder}", bold=True)
            demo.run()
            demo.final_status()
            display.say(f"done in {display.elapsed:.0f}s", bold=True)
        except DemoFailed as exc:
            display.say(f"demo FAILED: {exc}", bold=True)
            demo.tail_logs()
            with contextlib.suppress(Exception):
                demo.final_status()
            code = 1
        except KeyboardInterrupt:
            display.say("interrupted")
            code = 130
        finally:
            demo.cluster.stop_all()
            if demo.observer is not None:
                demo.observer.close()
            if demo.client is not None:
                demo.client.close()
            display.close()
            signal.signal(signal.SIGTERM, previous)
    return code


if __name__ == "__main__":
    sys.exit(main())
