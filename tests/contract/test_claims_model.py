"""A stateful model of the claim lifecycle over every store (memory and each SQL store).

Hypothesis interleaves reserve (duplicate deliveries, the same id twice in a batch,
several publications of one task id), start, renew, complete, release, requeue, expiry,
recover, mark_published, retention and stale credentials. After every step it reads
the claims' rows directly (``pulse_claims``, or the memory store's table) and checks six
invariants (the ``check_*`` functions below, each shown to catch a corrupted row by
``test_checkers_catch_corrupted_rows``); then it compares every row and every answer with
:class:`Model`, a reference of the contract in ``celery_pulse.store.contracts``.

Time: the store judges expiry by its own clock, which a test cannot move. Every lease is
granted for ``TTL`` (far longer than a run), and ``expire`` sets one claim's
``lease_until`` to the store clock minus a second: "the store clock moved past this
lease". Every expiry check compares ``lease_until`` with the store clock, so for every rule
this is the same as waiting, without sleeping.

The two store bugs the machine found (a later copy of a task id in a reserve batch was
decided by the first copy; a stale completion after the current one in a ``complete`` call
dropped the current outcome) have a minimal regression test each at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_pulse.store.base import (
    FAILED,
    FINISHED_STATES,
    LIVE_STATES,
    NEEDS_REVIEW,
    OPEN,
    POLICIES,
    RESERVED,
    RESTARTABLE_STATES,
    RETRY,
    REVOKED,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATES,
    Completion,
    Grant,
    Message,
    Refusal,
    ReserveRequest,
    Store,
    mask_token,
)
from celery_pulse.store.memory import MemoryStore
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.tables import claims
from tests.helpers.stores import (
    all_claim_rows,
    change_claim,
    claim_row,
    evidence_count,
    forget_claims,
)

TTL = 600.0
TASKS = ("t1", "t2", "t3")
WORKERS = ("w1", "w2")
SCANNER = "scanner"
HOLDERS = (*WORKERS, SCANNER)
PUBLICATIONS = ("p1", "p2", "p3", None)
#: Mostly redeliveries of p1 (duplicates, exhausted budgets), sometimes a new publication.
PUBLICATION = st.sampled_from(("p1", "p1", "p1", *PUBLICATIONS[1:]))
OUTCOMES = (SUCCEEDED, FAILED, REVOKED, RETRY)
OUTCOME_STATE = {SUCCEEDED: SUCCEEDED, FAILED: FAILED, REVOKED: REVOKED, RETRY: OPEN}
#: What the snapshot says about ``lease_until`` by the store clock (None: NULL).
LIVE, EXPIRED = "live", "expired"

#: The stores together stay well under a minute on a shared 2-core machine.
MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None,
                            database=None, print_blob=True,
                            suppress_health_check=[HealthCheck.too_slow])


# -- what the machine sees ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Claim:
    """One ``pulse_claims`` row, reduced to what the contract speaks about."""

    task_id: str
    state: str
    epoch: int
    holder: str | None
    token: str | None
    #: ``live`` / ``expired`` by the store clock, None when ``lease_until`` is NULL.
    lease: str | None
    attempts: int
    max_attempts: int
    policy: str
    publication: str | None
    outcome: str | None
    #: ``finished_at`` is set (retention purges by it).
    finished: bool

    def __repr__(self) -> str:
        return (f"Claim({self.task_id} {self.state} e{self.epoch} holder={self.holder} "
                f"token={mask_token(self.token or '')!r} lease={self.lease} "
                f"attempts={self.attempts}/{self.max_attempts} {self.policy} "
                f"pub={self.publication} outcome={self.outcome} finished={self.finished})")


@dataclasses.dataclass(frozen=True)
class Cred:
    """A credential the store handed out: a reservation ``grant`` or a ``publish`` lease."""

    task_id: str
    epoch: int
    token: str
    holder: str
    kind: str
    serial: int

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.task_id, self.epoch, self.token)

    def __repr__(self) -> str:
        return f"Cred({self.task_id} e{self.epoch} {self.holder} {self.kind} #{self.serial})"


@dataclasses.dataclass(frozen=True)
class Granted:
    """The model's prediction of a grant (the token is the store's to mint)."""

    task_id: str
    epoch: int
    attempts: int


def snapshot(store: Store) -> list[Claim]:
    """Every claim row, read directly, with the lease judged by the store clock."""
    if isinstance(store, MemoryStore):
        clock = store.now()
        return [Claim(r.task_id, r.state, r.epoch, r.holder, r.token,
                      None if r.lease_until is None else LIVE if r.lease_until > clock
                      else EXPIRED, r.attempts, r.max_attempts, r.policy, r.publication,
                      r.outcome, r.finished_at is not None) for r in all_claim_rows(store)]
    assert isinstance(store, SqlStore)
    now = store.dialect.now()
    lease = sa.case((claims.c.lease_until.is_(None), sa.null()),
                    (claims.c.lease_until > now, LIVE), else_=EXPIRED)
    stmt = sa.select(claims.c.task_id, claims.c.state, claims.c.epoch, claims.c.holder,
                     claims.c.token, lease.label("lease"), claims.c.attempts,
                     claims.c.max_attempts, claims.c.policy, claims.c.publication,
                     claims.c.outcome, claims.c.finished_at.is_not(None).label("finished")
                     ).order_by(claims.c.task_id)
    with store.engine.connect() as conn:
        return [Claim(r.task_id, r.state, int(r.epoch), r.holder, r.token, r.lease,
                      int(r.attempts), int(r.max_attempts), r.policy, r.publication, r.outcome,
                      bool(r.finished)) for r in conn.execute(stmt)]


def make_request(task_id: str, publication: str | None, policy: str = "redispatch",
                 max_attempts: int = 10) -> ReserveRequest:
    message = Message(b"[[], {}, {}]", {"id": task_id, "task": "proj.add", "retries": 0},
                      {"correlation_id": task_id}, {"routing_key": "celery"},
                      "application/json", "utf-8")
    return ReserveRequest(task_id, "proj.add", message, policy, max_attempts, 0, publication)


def expire(store: Store, task_id: str) -> int:
    """The store clock moved past this claim's live lease (see the module docstring)."""
    if isinstance(store, MemoryStore):
        row, clock = claim_row(store, task_id), store.now()
        if row.lease_until is None or row.lease_until <= clock:
            return 0
        return change_claim(store, task_id, lease_until=clock - 1.0)
    assert isinstance(store, SqlStore)
    stmt = (sa.update(claims)
            .where(claims.c.task_id == task_id, claims.c.lease_until > store.dialect.now())
            .values(lease_until=store.dialect.now() - 1.0))
    with store.engine.begin() as conn:
        return int(conn.execute(stmt).rowcount)


def _is_current(cred: Cred, row: Claim | None) -> bool:
    return row is not None and (row.epoch, row.token) == (cred.epoch, cred.token)


def _live(row: Claim) -> bool:
    return row.state in LIVE_STATES and row.lease == LIVE


# -- the invariants: pure functions of what was read, so a test can feed them corruption --
def check_one_live_grant(rows: Sequence[Claim], issued: Mapping[str, Sequence[Cred]]) -> list[str]:
    """1. One row per task id and at most one renewable credential: the newest grant.

    A live row must carry the credential of the latest grant the store handed out for
    that task (so no older grant is renewable again) and the grant's holder; tokens are
    never handed out twice.
    """
    out: list[str] = []
    ids = [r.task_id for r in rows]
    out += [f"invariant 1: {t} has {ids.count(t)} rows" for t in sorted(set(ids)) if ids.count(t) > 1]
    tokens = [c.token for creds in issued.values() for c in creds]
    if len(tokens) != len(set(tokens)):
        out.append("invariant 1: the store handed out the same token twice")
    for r in rows:
        if not _live(r):
            continue
        creds = issued.get(r.task_id, ())
        renewable = [c for c in creds if _is_current(c, r)]
        if len(renewable) != 1:
            out.append(f"invariant 1: live {r} matches {len(renewable)} credentials handed out")
        elif renewable[0] is not creds[-1] or renewable[0].kind != "grant":
            out.append(f"invariant 1: live {r} is held by {renewable[0]}, superseded by {creds[-1]}")
        elif renewable[0].holder != r.holder:
            out.append(f"invariant 1: live {r} changed holder under {renewable[0]}")
    return out


def check_epochs(before: Mapping[str, Claim], after: Mapping[str, Claim]) -> list[str]:
    """2. Epochs only grow; a new credential always comes with a new epoch; a new row
    (a first claim, or one after retention purged the last) starts at epoch 1."""
    out: list[str] = []
    for task_id, a in after.items():
        b = before.get(task_id)
        if b is None:
            if a.epoch != 1:
                out.append(f"invariant 2: new row {a} does not start at epoch 1")
        elif a.epoch < b.epoch:
            out.append(f"invariant 2: epoch went down: {b} -> {a}")
        elif a.epoch == b.epoch and a.token is not None and a.token != b.token:
            out.append(f"invariant 2: a new credential without a new epoch: {b} -> {a}")
    return out


def check_terminal(before: Mapping[str, Claim], after: Mapping[str, Claim]) -> list[str]:
    """3. A terminal claim keeps its outcome, except for a grant to a new publication (over
    succeeded/failed/revoked only); only retention deletes rows, only finished ones; the
    publication of a claim changes only with a grant."""
    out: list[str] = []
    for task_id, b in before.items():
        a = after.get(task_id)
        if a is None:
            if b.state not in FINISHED_STATES:
                out.append(f"invariant 3: {b} disappeared")
            continue
        if b.state in TERMINAL_STATES:
            same = (a.state, a.outcome, a.epoch, a.publication) == (b.state, b.outcome, b.epoch,
                                                                    b.publication)
            restarted = (b.state in RESTARTABLE_STATES and a.state == RESERVED
                         and a.epoch > b.epoch and a.attempts == 1 and a.publication is not None
                         and a.publication != b.publication)
            if not (same or restarted):
                out.append(f"invariant 3: terminal {b} became {a}")
        elif a.publication != b.publication and not (a.state == RESERVED and a.epoch > b.epoch):
            out.append(f"invariant 3: publication changed without a grant: {b} -> {a}")
    return out


def check_grant(grant: Grant, before: Claim | None, floor: int) -> list[str]:
    """4a. A grant's epoch is higher than the row's and than any earlier grant of the task
    (``floor``; both reset when retention purged the row)."""
    higher_than = max(before.epoch if before else 0, floor)
    if grant.epoch <= higher_than:
        return [f"invariant 4: {grant} is not above epoch {higher_than} (row {before})"]
    return []


def check_stale(op: str, creds: Sequence[Cred], answer: Mapping[str, str],
                before: Mapping[str, Claim]) -> list[str]:
    """4b. Only the current credential succeeds. ``answer``: task id -> ``applied`` for
    what the store says it did (``complete``: its own answers)."""
    out: list[str] = []
    for task_id, said in answer.items():
        current = [c for c in creds if c.task_id == task_id and _is_current(c, before.get(task_id))]
        if said == "applied" and not current:
            out.append(f"invariant 4: {op} applied {task_id} with a stale credential "
                       f"{[c for c in creds if c.task_id == task_id]} (row {before.get(task_id)})")
        if said not in ("applied", "evidence", "duplicate"):
            out.append(f"invariant 4: {op} answered {said!r} for {task_id}")
    return out


def check_row_shape(rows: Sequence[Claim]) -> list[str]:
    """5. Reserved/running rows have a holder, a credential and a lease (renewed or it
    expires); open rows are being published (holder, credential, lease) or published (no
    lease, no credential); terminal rows hold no credential; finished rows can be purged."""
    out: list[str] = []
    for r in rows:
        if r.state in LIVE_STATES:
            ok = r.holder is not None and r.token is not None and r.lease is not None
        elif r.state == OPEN:
            ok = (r.holder is not None and r.token is not None and r.lease is not None) or (
                r.token is None and r.lease is None)
        elif r.state in TERMINAL_STATES:
            ok = r.token is None and r.lease is None and (r.finished or r.state not in FINISHED_STATES)
        else:
            ok = False
        if not ok:
            out.append(f"invariant 5: malformed {r}")
    return out


def check_reservation(req: ReserveRequest, answer: Grant | Refusal, before: Claim | None) -> list[str]:
    """6. A delivery while the claim is live is refused ``taken`` (a duplicate, or a new
    publication waiting for the live run); a redelivery of a finished publication, or
    any delivery of a task in review, is refused ``terminal``."""
    if before is None:
        return []
    new_pub = req.publication is not None and req.publication != before.publication
    if _live(before):
        wanted = "taken"
    elif before.state == NEEDS_REVIEW or (before.state in TERMINAL_STATES and not new_pub):
        wanted = "terminal"
    else:
        return []
    if isinstance(answer, Refusal) and answer.reason == wanted:
        return []
    return [f"invariant 6: {req.task_id} publication {req.publication} over {before}: "
            f"{answer}, not refused {wanted}"]


# -- the reference -------------------------------------------------------------------------
class Model:
    """What the store must answer, per ``celery_pulse.store.base`` (tokens excepted: the
    machine copies each token the store mints into ``rows``)."""

    def __init__(self) -> None:
        self.rows: dict[str, Claim] = {}
        #: Rows in ``pulse_evidence``: every stale outcome is kept, none is dropped.
        self.evidence = 0

    def _held(self, cred: Cred) -> Claim | None:
        row = self.rows.get(cred.task_id)
        return row if _is_current(cred, row) else None

    def copy(self) -> Model:
        trial = Model()
        trial.rows, trial.evidence = dict(self.rows), self.evidence
        return trial

    def reserve(self, holder: str, requests: Sequence[ReserveRequest]
                ) -> tuple[list[Granted | Refusal], Model]:
        """The answers, and the model after the batch (a copy: the machine adopts it).

        "One result per request": each is decided against the claim as the earlier ones
        left it, also a later copy of a task id in the same batch (a redelivery of a copy
        just granted is ``taken``; a new publication behind a finished one runs).
        """
        trial = self.copy()
        return [trial._reserve_one(holder, req) for req in requests], trial

    def _reserve_one(self, holder: str, req: ReserveRequest) -> Granted | Refusal:
        t, c = req.task_id, self.rows.get(req.task_id)
        if c is None:
            self.rows[t] = Claim(t, RESERVED, 1, holder, None, LIVE, 1, req.max_attempts,
                                 req.policy, req.publication, None, False)
            return Granted(t, 1, 1)
        new_pub = req.publication is not None and req.publication != c.publication
        claimable = c.state == OPEN or (c.state == RESERVED and c.lease == EXPIRED) or (
            c.state == RUNNING and c.policy == "redispatch" and c.lease == EXPIRED)
        if ((new_pub or c.attempts < c.max_attempts) and claimable) or (
                new_pub and c.state in RESTARTABLE_STATES):
            attempts = 1 if new_pub else c.attempts + 1
            self.rows[t] = dataclasses.replace(
                c, state=RESERVED, epoch=c.epoch + 1, holder=holder, token=None, lease=LIVE,
                attempts=attempts, policy=req.policy, publication=req.publication, outcome=None,
                finished=False)
            return Granted(t, c.epoch + 1, attempts)
        if c.state in TERMINAL_STATES:
            reason = "terminal"
        elif claimable:  # the budget is spent: the claim fails
            reason = "exhausted"
            self.rows[t] = dataclasses.replace(c, state=FAILED, outcome="exhausted", lease=None,
                                               token=None, finished=True)
        else:
            reason = "taken"
        return Refusal(t, reason, c.state, c.holder, c.epoch, 0, c.publication)

    def start(self, holder: str, cred: Cred) -> bool:
        c = self._held(cred)
        if c is None or c.holder != holder or c.state != RESERVED or c.lease != LIVE:
            return False
        self.rows[cred.task_id] = dataclasses.replace(c, state=RUNNING, lease=LIVE)
        return True

    def renew(self, holder: str, creds: Sequence[Cred]) -> set[str]:
        return {cred.task_id for cred in creds
                if (c := self._held(cred)) is not None and c.holder == holder and _live(c)}

    def complete(self, cred: Cred, outcome: str) -> str:
        c, state = self._held(cred), OUTCOME_STATE[outcome]
        if c is not None and c.state in LIVE_STATES:  # expired but not taken over: still its own
            self.rows[cred.task_id] = dataclasses.replace(
                c, state=state, outcome=outcome, token=None, lease=None, finished=outcome != RETRY)
            return "applied"
        row = self.rows.get(cred.task_id)
        if row is not None and row.epoch == cred.epoch and row.state == state:
            return "duplicate"
        self.evidence += 1
        return "evidence"

    def complete_many(self, completions: Sequence[tuple[Cred, str]]
                      ) -> tuple[dict[str, set[str]], Model]:
        """Every completion is recorded, in order, as if sent alone (so the current
        attempt's outcome is never lost to a stale one's in the same call). A task's answer
        is one of its completions' answers, ``applied`` if one applied."""
        trial = self.copy()
        answers: dict[str, set[str]] = {}
        for cred, outcome in completions:
            answers.setdefault(cred.task_id, set()).add(trial.complete(cred, outcome))
        return answers, trial

    def release(self, holder: str, creds: Sequence[Cred], never_ran: bool) -> int:
        states = LIVE_STATES if never_ran else (RESERVED,)
        released = 0
        for cred in creds:
            c = self._held(cred)
            if c is not None and c.holder == holder and c.state in states:
                self.rows[cred.task_id] = dataclasses.replace(c, state=RESERVED, lease=EXPIRED)
                released += 1
        return released

    def requeue(self, holder: str, creds: Sequence[Cred]) -> list[tuple[str, str, str, int]]:
        out = []
        for cred in creds:
            c = self._held(cred)
            if c is not None and c.holder == holder and _live(c):
                self.rows[cred.task_id] = dataclasses.replace(
                    c, state=OPEN, epoch=c.epoch + 1, holder=holder, token=None, lease=LIVE,
                    outcome=RETRY)
                out.append((cred.task_id, OPEN, c.state, c.epoch + 1))
        return out

    def recover(self, scanner: str) -> list[tuple[str, str, str, int]]:
        out = []
        for t, c in sorted(self.rows.items()):
            if c.lease != EXPIRED or c.state not in (*LIVE_STATES, OPEN):
                continue
            if not (c.state in (RESERVED, OPEN) or c.policy == "redispatch"):
                # finished_at: when it entered review (retention never purges needs_review).
                new = dataclasses.replace(c, state=NEEDS_REVIEW, epoch=c.epoch + 1, token=None,
                                          lease=None, outcome="unknown", finished=True)
            elif c.attempts >= c.max_attempts:
                new = dataclasses.replace(c, state=FAILED, epoch=c.epoch + 1, token=None,
                                          lease=None, outcome="exhausted", finished=True)
            else:
                new = dataclasses.replace(c, state=OPEN, epoch=c.epoch + 1, holder=scanner,
                                          token=None, lease=LIVE)
            self.rows[t] = new
            out.append((t, new.state, c.state, new.epoch))
        return out

    def mark_published(self, creds: Sequence[Cred]) -> int:
        marked = 0
        for cred in creds:
            c = self._held(cred)
            if c is not None and c.state == OPEN:
                self.rows[cred.task_id] = dataclasses.replace(c, lease=None, holder=None, token=None)
                marked += 1
        return marked

    def purge(self) -> int:
        gone = [t for t, c in self.rows.items() if c.state in FINISHED_STATES and c.finished]
        for t in gone:
            del self.rows[t]
        self.evidence = 0  # older_than=-1: all of it
        return len(gone)

    def expire(self, task_id: str) -> int:
        c = self.rows.get(task_id)
        if c is None or c.lease != LIVE:
            return 0
        self.rows[task_id] = dataclasses.replace(c, lease=EXPIRED)
        return 1

    def learn_token(self, task_id: str, token: str | None) -> None:
        self.rows[task_id] = dataclasses.replace(self.rows[task_id], token=token)


def check_model(expected: Mapping[str, Claim], actual: Mapping[str, Claim]) -> list[str]:
    """Every row as the model predicts it (beyond the invariants: the whole contract)."""
    out = []
    for t in sorted(expected.keys() | actual.keys()):
        if expected.get(t) != actual.get(t):
            out.append(f"model: {t} expected {expected.get(t)}\n{'':18}got {actual.get(t)}")
    return out


def _same_answers(expected: Sequence[Granted | Refusal], got: Sequence[Grant | Refusal]) -> bool:
    """A grant as predicted (the token is the store's), or exactly the predicted refusal."""
    return len(expected) == len(got) and all(
        (isinstance(want, Granted) and isinstance(answer, Grant)
         and (want.task_id, want.epoch, want.attempts) == (answer.task_id, answer.epoch, answer.attempts))
        or want == answer for want, answer in zip(expected, got, strict=True))


def _answers_in(got: Mapping[str, str], allowed: Mapping[str, set[str]]) -> bool:
    """One answer per task id, among its completions' and ``applied`` if one applied."""
    return got.keys() == allowed.keys() and all(
        got[t] in allowed[t] and (got[t] == "applied" or "applied" not in allowed[t]) for t in got)


def _unique(creds: Sequence[Cred]) -> list[Cred]:
    return list({c.key: c for c in creds}.values())


# -- the machine -------------------------------------------------------------------------
#: None (mostly): the credential's own holder; else a holder who may not hold it.
WHO = st.sampled_from((None, None, None, *HOLDERS))
#: Usually act on a grant still held (deep lifecycles); stale picks have a rule of their own.
LATEST = st.sampled_from((True, True, False))
REQUESTS = st.tuples(st.sampled_from(TASKS), PUBLICATION,
                     st.sampled_from(POLICIES), st.sampled_from((10, 2)))


class ClaimsMachine(RuleBasedStateMachine):
    """Interleavings of the claim lifecycle on one real store (emptied per example)."""

    grants = Bundle("grants")
    published = Bundle("published")

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        forget_claims(store)
        self.model = Model()
        #: The last snapshot: what every check of a step's answers compares with.
        self.seen: dict[str, Claim] = {}
        self.issued: dict[str, list[Cred]] = {}
        self.by_holder: dict[str, list[Cred]] = {h: [] for h in HOLDERS}
        #: The highest epoch granted per task since its row last appeared.
        self.floor: dict[str, int] = {}
        self.serial = 0

    # -- bookkeeping -------------------------------------------------------------------
    def _issue(self, task_id: str, epoch: int, token: str, holder: str, kind: str) -> Cred:
        self.serial += 1
        cred = Cred(task_id, epoch, token, holder, kind, self.serial)
        self.issued.setdefault(task_id, []).append(cred)
        self.by_holder[holder].append(cred)
        return cred

    def _stale_grants(self) -> list[Cred]:
        return [c for creds in self.issued.values() for c in creds
                if c.kind == "grant" and not _is_current(c, self.seen.get(c.task_id))]

    @staticmethod
    def _fail(problems: list[str]) -> None:
        assert not problems, "\n".join(problems)

    # -- rules -------------------------------------------------------------------------
    @initialize(target=grants, holder=st.sampled_from(WORKERS),
                specs=st.lists(REQUESTS, min_size=1, max_size=3))
    def first_deliveries(self, holder: str, specs: list[tuple[str, str | None, str, int]]) -> Any:
        """Every example starts with a delivery (the other rules need a claim)."""
        return self.reserve(holder, specs, False, False)

    @rule(target=grants, holder=st.sampled_from(WORKERS),
          specs=st.lists(REQUESTS, min_size=1, max_size=3), again=st.booleans(),
          then_start=st.booleans())
    def reserve(self, holder: str, specs: list[tuple[str, str | None, str, int]],
                again: bool, then_start: bool) -> Any:
        """A batch of deliveries; ``again`` delivers the first one twice in the batch;
        ``then_start``: the holder starts what it got at once, as a worker does."""
        requests = [make_request(*spec) for spec in specs]
        if again:
            requests.append(requests[0])
        expected, after = self.model.reserve(holder, requests)
        answers = self.store.reserve(holder, requests, TTL)
        self.model = after
        problems: list[str] = []
        granted: dict[str, Grant] = {}
        new: list[Cred] = []
        for req, want, got in zip(requests, expected, answers, strict=True):
            event(f"reserve: {type(got).__name__} {getattr(got, 'reason', '')} "
                  f"{getattr(got, 'state', '')}".strip())
            earlier = granted.get(req.task_id)
            before = self.seen.get(req.task_id)
            if earlier is not None:  # the first copy in this batch made the claim live
                before = Claim(req.task_id, RESERVED, earlier.epoch, holder, earlier.token, LIVE,
                               earlier.attempts, 0, req.policy, req.publication, None, False)
            problems += check_reservation(req, got, before)
            if isinstance(got, Grant):
                problems += check_grant(got, self.seen.get(req.task_id), self.floor.get(req.task_id, 0))
                self.floor[req.task_id] = max(self.floor.get(req.task_id, 0), got.epoch)
                granted[req.task_id] = got
                new.append(self._issue(got.task_id, got.epoch, got.token, holder, "grant"))
            if not _same_answers([want], [got]):
                problems.append(f"model: reserve({req.task_id}, {req.publication}) "
                                f"expected {want}, got {got}")
            elif isinstance(got, Grant):
                self.model.learn_token(got.task_id, got.token)
        self._fail(problems)
        if then_start and new:
            self.rows_keep_the_invariants()  # the reservation is a step of its own
            for cred in new:
                self.start(cred, None)
        return multiple(*new)

    def _pick(self, cred: Cred, latest: bool, states: Sequence[str] = LIVE_STATES) -> Cred:
        """``latest``: a grant still held (of the same task if it has one) instead of the
        drawn one, which is most often superseded or finished: deeper lifecycles."""
        if not latest:
            return cred
        held = [c for creds in self.issued.values() for c in creds if c.kind == "grant"
                and (row := self.seen.get(c.task_id)) is not None and _is_current(c, row)
                and row.state in states]
        held.sort(key=lambda c: c.task_id != cred.task_id)
        return held[0] if held else cred

    @rule(cred=grants, who=WHO, latest=LATEST)
    def start(self, cred: Cred, who: str | None, latest: bool = False) -> None:
        cred = self._pick(cred, latest, (RESERVED,))
        holder = who or cred.holder
        want = self.model.start(holder, cred)
        got = cred.task_id in self.store.start_many(holder, [cred.key], TTL)
        event(f"start: {'applied' if got else 'refused'}")
        problems = check_stale("start", [cred], {cred.task_id: "applied"} if got else {}, self.seen)
        if got != want:
            problems.append(f"model: start({holder}, {cred}) expected {want}, got {got}")
        self._fail(problems)

    @rule(holder=st.sampled_from(HOLDERS), extra=st.lists(grants, max_size=2))
    def renew(self, holder: str, extra: list[Cred]) -> None:
        """Everything ``holder`` was ever given (stale ones included), plus others' grants."""
        creds = _unique([*self.by_holder[holder], *extra])
        want = self.model.renew(holder, creds)
        renewed, busy = self.store.renew(holder, [c.key for c in creds], TTL)
        problems = check_stale("renew", creds, dict.fromkeys(renewed, "applied"), self.seen)
        if (renewed, busy) != (want, set()):
            problems.append(f"model: renew({holder}, {creds}) expected {want}, got {renewed}, {busy}")
        self._fail(problems)

    @rule(cred=grants, outcome=st.sampled_from(OUTCOMES), who=WHO, latest=LATEST)
    def complete(self, cred: Cred, outcome: str, who: str | None, latest: bool) -> None:
        cred = self._pick(cred, latest)
        self._complete(cred, outcome, who or cred.holder)

    def _complete(self, cred: Cred, outcome: str, holder: str) -> None:
        want = self.model.complete(cred, outcome)
        got = self.store.complete(holder, [Completion(cred.task_id, cred.epoch, cred.token, outcome)])
        event(f"complete: {outcome} {got.get(cred.task_id)}")
        problems = check_stale("complete", [cred], got, self.seen)
        if got != {cred.task_id: want}:
            problems.append(f"model: complete({cred}, {outcome}) expected {want}, got {got}")
        self._fail(problems)

    @rule(first=grants, outcome=st.sampled_from(OUTCOMES), latest=LATEST,
          others=st.lists(st.tuples(grants, st.sampled_from(OUTCOMES)), min_size=1, max_size=2))
    def complete_batch(self, first: Cred, outcome: str, latest: bool,
                       others: list[tuple[Cred, str]]) -> None:
        """One group commit of several outcomes, maybe two attempts of one task (a lost
        attempt still running beside the new one, both ending within one LINGER)."""
        first = self._pick(first, latest)
        batch = list({cred.key: (cred, out) for cred, out in [(first, outcome), *others]}.values())
        expected, after = self.model.complete_many(batch)
        got = self.store.complete(first.holder, [Completion(c.task_id, c.epoch, c.token, out)
                                                 for c, out in batch])
        problems = check_stale("complete", [c for c, _ in batch], got, self.seen)
        self.model = after
        if not _answers_in(got, expected):
            problems.append(f"model: complete({batch}) expected one of {expected}, got {got}")
        self._fail(problems)

    @rule(creds=st.lists(grants, min_size=1, max_size=3), who=WHO, never_ran=st.booleans())
    def release(self, creds: list[Cred], who: str | None, never_ran: bool) -> None:
        holder = who or creds[0].holder
        creds = _unique(creds)
        want = self.model.release(holder, creds, never_ran)
        got = self.store.release(holder, [c.key for c in creds], never_ran=never_ran)
        current = sum(_is_current(c, self.seen.get(c.task_id)) for c in creds)
        problems = [] if got <= current else [
            f"invariant 4: release of {creds} moved {got} claims, only {current} credentials current"]
        if got != want:
            problems.append(f"model: release({holder}, {creds}, never_ran={never_ran}) "
                            f"expected {want}, got {got}")
        self._fail(problems)

    @rule(target=published, cred=grants, who=WHO, latest=LATEST)
    def requeue(self, cred: Cred, who: str | None, latest: bool) -> Any:
        cred = self._pick(cred, latest)
        holder = who or cred.holder
        want = self.model.requeue(holder, [cred])
        got = self.store.requeue(holder, [cred.key], TTL)
        problems = check_stale("requeue", [cred], {r.task_id: "applied" for r in got}, self.seen)
        return self._took_over(f"requeue({holder}, {cred})", holder, want, got, problems)

    @precondition(lambda self: any(c.lease == EXPIRED for c in self.model.rows.values()))
    @rule(target=published, scanner=st.sampled_from((SCANNER, "w1")))
    def recover(self, scanner: str) -> Any:
        want = self.model.recover(scanner)
        got = self.store.recover(scanner, 10, TTL)
        return self._took_over(f"recover({scanner})", scanner, want, got, [])

    def _took_over(self, call: str, holder: str, want: list[tuple[str, str, str, int]],
                   got: list[Any], problems: list[str]) -> Any:
        """Recover and requeue: compare, learn the publish tokens, hand them out."""
        for r in got:
            problems += check_grant(Grant(r.task_id, r.epoch, r.token or "", 0, 0),
                                    self.seen.get(r.task_id), 0)
        seen = sorted((r.task_id, r.state, r.was, r.epoch) for r in got)
        for r in got:
            event(f"{call.split('(')[0]}: {r.was} -> {r.state}")
        if seen != sorted(want):
            problems.append(f"model: {call} expected {sorted(want)}, got {seen}")
        self._fail(problems)
        new = []
        for r in got:
            self.model.learn_token(r.task_id, r.token)
            if r.token is not None:
                new.append(self._issue(r.task_id, r.epoch, r.token, holder, "publish"))
        return multiple(*new)

    @rule(creds=st.lists(published, min_size=1, max_size=2))
    def mark_published(self, creds: list[Cred]) -> None:
        creds = _unique(creds)
        want = self.model.mark_published(creds)
        got = self.store.mark_published([c.key for c in creds])
        current = sum(_is_current(c, self.seen.get(c.task_id)) for c in creds)
        problems = [] if got <= current else [
            f"invariant 4: mark_published of {creds} moved {got} claims, {current} current"]
        if got != want:
            problems.append(f"model: mark_published({creds}) expected {want}, got {got}")
        self._fail(problems)

    @precondition(lambda self: any(c.lease == LIVE for c in self.model.rows.values()))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """The store clock moved past a live lease (see the module docstring)."""
        task_id = data.draw(st.sampled_from(sorted(t for t, c in self.model.rows.items()
                                                   if c.lease == LIVE)), label="task_id")
        want = self.model.expire(task_id)
        got = expire(self.store, task_id)
        event(f"expire: {self.model.rows[task_id].state}")
        self._fail([] if got == want else [f"model: expire({task_id}) expected {want}, got {got}"])

    @precondition(lambda self: any(c.state in FINISHED_STATES for c in self.model.rows.values()))
    @rule()
    def purge_finished(self) -> None:
        want = self.model.purge()
        got = self.store.purge_finished(older_than=-1)
        self._fail([] if got == want else [f"model: purge_finished expected {want}, got {got}"])

    @precondition(lambda self: bool(self._stale_grants()))
    @rule(data=st.data(), op=st.sampled_from(("complete", "renew", "start")),
          outcome=st.sampled_from(OUTCOMES))
    def stale_credential(self, data: st.DataObject, op: str, outcome: str) -> None:
        """A holder acting on a grant the model knows is superseded (or purged)."""
        stale = self._stale_grants()
        # The most dangerous: a credential from before a purge whose epoch the new row reuses.
        reused = [c for c in stale if (row := self.seen.get(c.task_id)) and row.epoch == c.epoch]
        pool = reused if reused and data.draw(st.booleans(), label="reused epoch") else stale
        cred = data.draw(st.sampled_from(pool), label="stale")
        if op == "complete":
            self._complete(cred, outcome, cred.holder)
        elif op == "renew":
            got, _ = self.store.renew(cred.holder, [cred.key], TTL)
            self._fail(check_stale("renew", [cred], dict.fromkeys(got, "applied"), self.seen))
        else:
            self.start(cred, None)

    @invariant()
    def rows_keep_the_invariants(self) -> None:
        rows = snapshot(self.store)
        after = {r.task_id: r for r in rows}
        problems = [*check_one_live_grant(rows, self.issued), *check_epochs(self.seen, after),
                    *check_terminal(self.seen, after), *check_row_shape(rows),
                    *check_model(self.model.rows, after)]
        kept = evidence_count(self.store)
        if kept != self.model.evidence:
            problems.append(f"model: {kept} evidence rows, expected {self.model.evidence}")
        for task_id in self.seen.keys() - after.keys():
            self.floor.pop(task_id, None)  # purged: the next row starts over at epoch 1
        self.seen = after
        self._fail(problems)



# -- tests ---------------------------------------------------------------------------------
@pytest.fixture
def model_store(store: Store) -> Store:
    """The contract fixture's store (memory and every SQL store)."""
    return store


@pytest.fixture
def hypothesis_home(tmp_path: Path) -> Iterator[None]:
    """No ``.hypothesis`` in the repo: with ``database=None`` only Hypothesis' cache of
    source constants still writes there, so it goes to this test's temporary directory."""
    set_hypothesis_home_dir(tmp_path / "hypothesis")
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)  # back to the default


class TestClaimsModel:
    """The machine on each store; a failure prints the steps and a ``@reproduce_failure``
    blob (``print_blob``)."""

    def test_interleavings_keep_the_invariants(self, model_store: Store, hypothesis_home: None
                                               ) -> None:
        run_state_machine_as_test(lambda: ClaimsMachine(model_store), settings=MACHINE_SETTINGS)


def test_checkers_catch_corrupted_rows(model_store: Store) -> None:
    """Each invariant is not vacuous: a row corrupted behind the store's back is reported."""
    store = model_store

    def corrupt(task_id: str, **values: Any) -> None:
        change_claim(store, task_id, **values)

    def rows() -> dict[str, Claim]:
        return {r.task_id: r for r in snapshot(store)}

    def reserve(task_id: str, holder: str = "w1", publication: str | None = "p1") -> Grant:
        (got,) = store.reserve(holder, [make_request(task_id, publication)], TTL)
        assert isinstance(got, Grant), got
        return got

    def cred(g: Grant, serial: int, holder: str = "w1") -> Cred:
        return Cred(g.task_id, g.epoch, g.token, holder, "grant", serial)

    def reports(number: int, problems: list[str]) -> bool:
        return any(p.startswith(f"invariant {number}:") for p in problems)

    old = reserve("a")
    store.release("w1", [(old.task_id, old.epoch, old.token)])
    new = reserve("a")
    done = reserve("b")
    assert store.complete("w1", [Completion("b", done.epoch, done.token, SUCCEEDED)]) == {"b": "applied"}
    issued = {"a": [cred(old, 1), cred(new, 2)], "b": [cred(done, 3)]}
    clean = rows()
    assert not check_one_live_grant(list(clean.values()), issued)
    assert not check_row_shape(list(clean.values()))

    # 1: the superseded grant is live again (a store that re-granted an old credential).
    corrupt("a", epoch=old.epoch, token=old.token)
    assert reports(1, check_one_live_grant(list(rows().values()), issued))
    # 2: the epoch went down.
    assert reports(2, check_epochs(clean, rows()))
    corrupt("a", epoch=new.epoch, token=new.token)
    assert not check_epochs(clean, rows())
    # 3: a finished claim changed its outcome without a new publication.
    corrupt("b", state=FAILED, outcome=FAILED)
    assert reports(3, check_terminal(clean, rows()))
    corrupt("b", state=SUCCEEDED, outcome=SUCCEEDED)
    # 5: a reserved row that would never expire.
    corrupt("a", lease_until=None)
    assert reports(5, check_row_shape(list(rows().values())))
    corrupt("a", lease_until=store.now() + TTL)
    assert not check_row_shape(list(rows().values()))
    # 4: the stale credential renews once the row is made to carry it again ...
    corrupt("a", epoch=old.epoch, token=old.token)
    renewed, _ = store.renew("w1", [(old.task_id, old.epoch, old.token)], TTL)
    assert reports(4, check_stale("renew", [cred(old, 1)], dict.fromkeys(renewed, "applied"), clean))
    # ... and a grant over a row whose epoch went back is not above the earlier grants.
    expire(store, "a")
    regrant = reserve("a", "w2")
    assert reports(4, check_grant(regrant, clean["a"], new.epoch))
    # 6: a store that forgot a live lease grants a duplicate delivery of it.
    live = reserve("c")
    seen = rows()["c"]
    expire(store, "c")
    duplicate = store.reserve("w2", [make_request("c", "p1")], TTL)[0]
    assert isinstance(duplicate, Grant) and live.epoch < duplicate.epoch
    assert reports(6, check_reservation(make_request("c", "p1"), duplicate, seen))
    # ... and a finished publication reserved again is not refused terminal.
    assert reports(6, check_reservation(make_request("b", "p1"), regrant, clean["b"]))


# -- the bugs the machine found: minimal regressions -------------------------------------
def test_a_later_copy_in_a_reserve_batch_sees_what_the_earlier_left(model_store: Store) -> None:
    """Each request is decided against the claim as the earlier ones left it.

    Found by the machine: the store decided every copy of a task id in one batch by the
    first (``unique.setdefault``), so p2 below was refused ``terminal`` and lost, and the
    second copy of t2 was refused with its own publication instead of the claim's.
    """
    store = model_store
    (g,) = store.reserve("w1", [make_request("t1", "p1")], TTL)
    assert isinstance(g, Grant)
    store.complete("w1", [Completion("t1", g.epoch, g.token, SUCCEEDED)])
    dup, again = store.reserve("w2", [make_request("t1", "p1"), make_request("t1", "p2")], TTL)
    assert isinstance(dup, Refusal) and dup.reason == "terminal", dup
    # p2 is a new publication of a finished task: it runs again (alone, it is granted).
    assert isinstance(again, Grant) and (again.epoch, again.attempts) == (2, 1), again
    _, second = store.reserve("w1", [make_request("t2", "p2"), make_request("t2", "p1")], TTL)
    # Refusal.publication is "the publication the claim currently belongs to": p2.
    assert isinstance(second, Refusal) and (second.reason, second.publication) == ("taken", "p2")


def test_a_stale_completion_does_not_drop_the_current_one(model_store: Store) -> None:
    """Two attempts of one task completed in one call (one group commit): the current applies.

    Found by the machine: the store kept only the last completion per task id, so the
    current attempt's outcome was dropped (not even kept as evidence) and the claim stayed
    reserved until Recover re-ran the task.
    """
    store = model_store
    (g1,) = store.reserve("w1", [make_request("t1", "p1")], TTL)
    assert isinstance(g1, Grant)
    store.release("w1", [(g1.task_id, g1.epoch, g1.token)])
    (g2,) = store.reserve("w1", [make_request("t1", "p1")], TTL)
    assert isinstance(g2, Grant)
    got = store.complete("w1", [Completion("t1", g2.epoch, g2.token, SUCCEEDED),
                                Completion("t1", g1.epoch, g1.token, FAILED)])
    (row,) = snapshot(store)
    assert (row.state, row.epoch, got) == (SUCCEEDED, g2.epoch, {"t1": "applied"}), (got, row)
