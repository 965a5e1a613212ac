"""The worker-registry contract (see ``celery_pulse.store.base``), on every store.

Each test runs once per store; the store is visible in the test id
(``[memory]``, ``[sqlite]``, ``[postgres]``, ``[mariadb]``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from celery_pulse.errors import NotRegistered
from celery_pulse.store.base import RegistryStore as Store
from celery_pulse.store.base import WorkerInfo
from celery_pulse.testing import wait_for
from tests.helpers.stores import other_handle

WID = "worker-1@host"
LABELS = {"queues": ["celery", "high"], "pid": 1234, "host": "host"}
#: Allowed difference between two readings of the store clock in one test step.
SLACK = 5.0
#: How long a test waits for something the store clock decides.
WAIT = 15.0


# -- helpers ---------------------------------------------------------------------------
def info(store: Store, worker_id: str = WID) -> WorkerInfo:
    found = [w for w in store.list_workers() if w.worker_id == worker_id]
    assert len(found) == 1, f"{worker_id} not listed exactly once: {found}"
    return found[0]


def expired(store: Store, worker_id: str = WID) -> bool:
    return not info(store, worker_id).alive


def set_draining(store: Store, worker_id: str) -> None:
    """Set the drain flag as an operator would (`celery pulse drain`)."""
    store.set_drain(worker_id, True, "test")


def reason_of(call: Callable[[], object]) -> str:
    with pytest.raises(NotRegistered) as exc_info:
        call()
    return exc_info.value.reason


# -- register ---------------------------------------------------------------------------
def test_register_mints_a_128_bit_token_and_expiry(store: Store) -> None:
    before = store.now()
    reg = store.register(WID, LABELS, 30.0)
    after = store.now()
    assert reg.worker_id == WID
    assert len(reg.token) >= 32
    assert int(reg.token, 16) >= 0  # hex
    assert reg.token == reg.token.lower()
    assert before + 30.0 - 0.01 <= reg.expires_at <= after + 30.0 + 0.01
    assert reg.token not in repr(reg)


def test_tokens_are_fresh(store: Store) -> None:
    tokens = {store.register(f"w{i}", {}, 30.0).token for i in range(5)}
    tokens |= {store.register("w0", {}, 30.0).token for _ in range(5)}
    assert len(tokens) == 10


def test_register_lists_labels_and_times(store: Store) -> None:
    reg = store.register(WID, LABELS, 30.0)
    w = info(store)
    assert dict(w.labels) == LABELS
    assert w.alive and not w.draining
    assert w.expires_at == pytest.approx(reg.expires_at)
    assert w.registered_at == pytest.approx(w.last_heartbeat)
    assert w.expires_at - w.registered_at == pytest.approx(30.0, abs=0.01)
    assert 30.0 - SLACK < w.expires_in <= 30.0


# -- heartbeat --------------------------------------------------------------------------
def test_heartbeat_extends(store: Store) -> None:
    reg = store.register(WID, LABELS, 5.0)
    before = store.now()
    beat = store.heartbeat(WID, reg.token, 600.0)
    assert beat.draining is False
    assert beat.expires_at >= before + 600.0 - 0.01
    assert beat.expires_at > reg.expires_at + 500.0
    w = info(store)
    assert w.expires_at == pytest.approx(beat.expires_at)
    assert 600.0 - SLACK < w.expires_in <= 600.0
    assert w.last_heartbeat >= w.registered_at
    # Heartbeat can also shorten: the new expiry is store_now + ttl, not max().
    beat2 = store.heartbeat(WID, reg.token, 5.0)
    assert beat2.expires_at < beat.expires_at
    assert 0 < info(store).expires_in <= 5.0


def test_reregister_same_id_replaces_old_token(store: Store) -> None:
    old = store.register(WID, {"gen": 1}, 30.0)
    new = store.register(WID, {"gen": 2}, 30.0)
    assert new.token != old.token
    assert reason_of(lambda: store.heartbeat(WID, old.token, 30.0)) == NotRegistered.REPLACED
    store.heartbeat(WID, new.token, 30.0)
    assert dict(info(store).labels) == {"gen": 2}
    assert len(store.list_workers()) == 1


def test_wrong_token(store: Store) -> None:
    store.register(WID, LABELS, 30.0)
    assert reason_of(lambda: store.heartbeat(WID, "0" * 32, 30.0)) == NotRegistered.REPLACED
    assert reason_of(lambda: store.heartbeat(WID, "", 30.0)) == NotRegistered.REPLACED


def test_unknown_worker_is_missing(store: Store) -> None:
    assert reason_of(lambda: store.heartbeat("nobody", "0" * 32, 30.0)) == NotRegistered.MISSING


# -- deregister -------------------------------------------------------------------------
def test_deregister(store: Store) -> None:
    reg = store.register(WID, LABELS, 30.0)
    assert store.deregister(WID, "f" * 32) is False
    assert store.deregister("nobody", reg.token) is False
    assert info(store).alive
    store.heartbeat(WID, reg.token, 30.0)
    assert store.deregister(WID, reg.token) is True
    assert store.list_workers() == []
    assert reason_of(lambda: store.heartbeat(WID, reg.token, 30.0)) == NotRegistered.MISSING
    assert store.deregister(WID, reg.token) is False


def test_old_token_cannot_deregister_a_newer_registration(store: Store) -> None:
    old = store.register(WID, LABELS, 30.0)
    new = store.register(WID, LABELS, 30.0)
    assert store.deregister(WID, old.token) is False
    store.heartbeat(WID, new.token, 30.0)


# -- list_workers and expiry by the store clock ---------------------------------------------
def test_list_workers_alive_and_expires_in(store: Store) -> None:
    store.register("b-long", {"n": 2}, 600.0)
    store.register("a-short", {"n": 1}, 0.3)
    store.register("c-mid", {"n": 3}, 60.0)
    wait_for(lambda: expired(store, "a-short"), timeout=WAIT, what="a-short to expire")
    listed = store.list_workers()
    assert [w.worker_id for w in listed] == ["a-short", "b-long", "c-mid"]
    short, long_, mid = listed
    assert not short.alive and -SLACK - 15 < short.expires_in <= 0
    assert long_.alive and 600.0 - SLACK - 15 < long_.expires_in <= 600.0
    assert mid.alive and 60.0 - SLACK - 15 < mid.expires_in <= 60.0
    for w in listed:
        assert w.expires_at - w.expires_in == pytest.approx(listed[0].expires_at
                                                            - listed[0].expires_in, abs=0.5)


def test_expiry_by_store_clock(store: Store) -> None:
    reg = store.register(WID, LABELS, 0.3)
    wait_for(lambda: expired(store), timeout=WAIT, what="the registration to expire")
    w = info(store)
    assert w.expires_in <= 0
    assert store.now() >= reg.expires_at
    assert reason_of(lambda: store.heartbeat(WID, reg.token, 30.0)) == NotRegistered.EXPIRED
    # A failed heartbeat does not revive the row.
    assert not info(store).alive
    # Another token on a dead row is "expired" too, not "replaced".
    assert reason_of(lambda: store.heartbeat(WID, "0" * 32, 30.0)) == NotRegistered.EXPIRED


def test_register_without_replacing_live(store: Store) -> None:
    live = store.register(WID, {"gen": 1}, 30.0)
    with pytest.raises(NotRegistered) as exc_info:
        store.register(WID, {"gen": 2}, 30.0, replace_live=False)
    assert exc_info.value.reason == NotRegistered.REPLACED
    # The live registration is untouched.
    store.heartbeat(WID, live.token, 30.0)
    assert dict(info(store).labels) == {"gen": 1}


def test_register_without_replacing_takes_expired_or_free_name(store: Store) -> None:
    free = store.register("fresh", {}, 30.0, replace_live=False)
    store.heartbeat("fresh", free.token, 30.0)

    dead = store.register(WID, {"gen": 1}, 0.3)
    wait_for(lambda: expired(store), timeout=WAIT, what="the registration to expire")
    new = store.register(WID, {"gen": 2}, 30.0, replace_live=False)
    assert new.token != dead.token
    store.heartbeat(WID, new.token, 30.0)
    w = info(store)
    assert w.alive and dict(w.labels) == {"gen": 2}
    assert w.registered_at == pytest.approx(w.last_heartbeat, abs=0.5)
    assert reason_of(lambda: store.heartbeat(WID, dead.token, 30.0)) == NotRegistered.REPLACED


# -- drain flag --------------------------------------------------------------------------------
def test_drain_flag_reported_and_survives_reregister(store: Store) -> None:
    reg = store.register(WID, LABELS, 30.0)
    assert store.heartbeat(WID, reg.token, 30.0).draining is False
    set_draining(store, WID)
    assert store.heartbeat(WID, reg.token, 30.0).draining is True
    assert info(store).draining is True

    again = store.register(WID, LABELS, 30.0)
    assert info(store).draining is True
    assert store.heartbeat(WID, again.token, 30.0).draining is True


def test_drain_flag_survives_taking_back_an_expired_name(store: Store) -> None:
    store.register(WID, LABELS, 0.3)
    set_draining(store, WID)
    wait_for(lambda: expired(store), timeout=WAIT, what="the registration to expire")
    back = store.register(WID, LABELS, 30.0, replace_live=False)
    assert store.heartbeat(WID, back.token, 30.0).draining is True


def test_drain_is_persistent_across_restarts_until_undrain(store: Store) -> None:
    reg = store.register(WID, LABELS, 30.0)
    set_draining(store, WID)
    assert store.deregister(WID, reg.token)
    restarted = store.register(WID, LABELS, 30.0)
    assert restarted.draining is True
    store.set_drain(WID, False, "test")
    assert store.heartbeat(WID, restarted.token, 30.0).draining is False
    assert store.register(WID, LABELS, 30.0).draining is False


# -- the store judges time, not the process ------------------------------------------------
@pytest.mark.parametrize("skew", [3600.0, -3600.0], ids=["ahead", "behind"])
def test_process_clock_is_irrelevant(store: Store, monkeypatch: pytest.MonkeyPatch,
                                     skew: float) -> None:
    ttl = 30.0
    base = store.now()
    real_time, real_monotonic = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + skew)
    assert abs(time.time() - real_time() - skew) < 1  # the patch is in effect

    reg = store.register(WID, LABELS, ttl)
    assert base + ttl - 0.01 <= reg.expires_at <= base + ttl + SLACK
    beat = store.heartbeat(WID, reg.token, ttl)
    assert base + ttl - 0.01 <= beat.expires_at <= base + ttl + SLACK
    assert abs(store.now() - base) < SLACK
    w = info(store)
    assert w.alive
    assert ttl - SLACK < w.expires_in <= ttl
    assert store.deregister(WID, reg.token)


# -- concurrency: a replaced token never wins after the replacement returned ----------------
@dataclass(frozen=True)
class Beat:
    token: str
    started: float
    ended: float
    ok: bool
    reason: str


class Heartbeater(threading.Thread):
    """Heartbeats ``self.token`` in a tight loop from its own store handle."""

    def __init__(self, handle: Store) -> None:
        super().__init__(name="contract-heartbeater", daemon=True)
        self.handle = handle
        self.token = ""
        self.beats: list[Beat] = []
        self.errors: list[BaseException] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            token = self.token
            started = time.monotonic()
            try:
                self.handle.heartbeat(WID, token, 30.0)
            except NotRegistered as exc:
                self.beats.append(Beat(token, started, time.monotonic(), False, exc.reason))
            except BaseException as exc:  # surfaced by the test, not swallowed
                self.errors.append(exc)
                return
            else:
                self.beats.append(Beat(token, started, time.monotonic(), True, ""))

    def count(self, pred: Callable[[Beat], bool]) -> int:
        return sum(1 for b in list(self.beats) if pred(b))


def test_replaced_token_never_wins_after_replacement(store: Store) -> None:
    min_rounds, max_rounds = 5, 60
    token = store.register(WID, LABELS, 30.0).token
    #: token -> (register(successor) started, register(successor) returned)
    replaced: dict[str, tuple[float, float]] = {}
    overlaps = 0
    with other_handle(store) as handle:
        hb = Heartbeater(handle)
        hb.token = token
        hb.start()
        try:
            rounds = 0
            while rounds < min_rounds or (overlaps == 0 and rounds < max_rounds):
                rounds += 1
                old = token
                wait_for(lambda old=old: hb.count(lambda b: b.token == old and b.ok) >= 2
                           or bool(hb.errors), timeout=WAIT, what="heartbeats with the current token")
                started = time.monotonic()
                token = store.register(WID, LABELS, 30.0).token
                returned = time.monotonic()
                replaced[old] = (started, returned)
                wait_for(lambda old=old, returned=returned: hb.count(
                    lambda b: b.token == old and b.started > returned) >= 2 or bool(hb.errors),
                    timeout=WAIT, what="heartbeats with the replaced token")
                overlaps += hb.count(lambda b, s=started, r=returned: b.started < r
                                     and b.ended > s)
                hb.token = token
        finally:
            hb.halt.set()
            hb.join(timeout=30)
    assert not hb.is_alive()
    assert not hb.errors, hb.errors

    beats = hb.beats
    late = [b for b in beats if b.token in replaced and b.started > replaced[b.token][1]]
    assert len(late) >= 2 * len(replaced)
    won = [b for b in late if b.ok]
    assert not won, f"{len(won)} heartbeats with a replaced token succeeded: {won[:3]}"
    assert {b.reason for b in late} == {NotRegistered.REPLACED}
    # Before its replacement started, a token always worked (the lease was live).
    early = [b for b in beats if b.token in replaced and b.ended < replaced[b.token][0]]
    assert len(early) >= 2 * len(replaced)
    assert all(b.ok for b in early)
    # The heartbeater really ran alongside the re-registrations.
    assert overlaps >= 1
    # The final token is the live one.
    store.heartbeat(WID, token, 30.0)
