"""The leader and beat contract (``LeaderStore``/``BeatStore`` in ``celery_pulse.store.contracts``).

Each test runs once per store (``[memory]``, ``[sqlite]``, ``[postgres]``, ``[mariadb]``). "Expired" is
decided by the store clock: tests that need an expiry use a short TTL and poll
``get_leader`` with a deadline, never compare their own clock with a stored time.
"""

from __future__ import annotations

import contextlib
import threading

from celery_pulse.beat import slot_task_id
from celery_pulse.store.base import LeaderGrant, ScheduleRow, Slot, Store
from celery_pulse.testing import wait_for
from tests.helpers.stores import other_handle, slot_rows

KEY = "beat"
TTL = 30.0
SHORT = 0.3


def acquire(store: Store, holder: str, ttl: float = TTL, token: str | None = None
            ) -> LeaderGrant:
    grant = store.try_acquire(KEY, holder, ttl, token=token)
    assert grant is not None, f"{holder} could not acquire {KEY}"
    return grant


def expire(store: Store) -> None:
    """Wait until the current term of KEY is over by the store clock."""
    wait_for(lambda: not _alive(store), 10, "the leader lease to expire by the store clock")


def _alive(store: Store, key: str = KEY) -> bool:
    info = store.get_leader(key)
    return info is not None and info.alive


def slot(due_at: float, entry: str = "e") -> Slot:
    return Slot(entry, due_at, slot_task_id(entry, due_at), "proj.tick",
                '{"args": [], "kwargs": {}, "options": {}}')


# -- try_acquire / release / get_leader ----------------------------------------------
def test_acquire_a_free_key(store: Store) -> None:
    assert store.get_leader(KEY) is None
    before = store.now()
    grant = acquire(store, "a")
    assert (grant.key, grant.holder, grant.epoch) == (KEY, "a", 1)
    assert len(grant.token) >= 32
    assert before + TTL - 5 <= grant.lease_until <= store.now() + TTL
    info = store.get_leader(KEY)
    assert info is not None and info.holder == "a" and info.epoch == 1 and info.alive
    assert 0 < info.lease_remaining <= TTL


def test_live_lease_of_another_holder_is_refused(store: Store) -> None:
    grant = acquire(store, "a")
    assert store.try_acquire(KEY, "b", TTL) is None
    assert store.try_acquire(KEY, "b", TTL, token="not-the-token") is None
    # The same holder without the token is not a renewal either (a restarted process).
    assert store.try_acquire(KEY, "a", TTL) is None
    info = store.get_leader(KEY)
    assert info is not None and (info.holder, info.epoch) == ("a", grant.epoch)


def test_renewal_with_our_token_keeps_token_and_epoch(store: Store) -> None:
    first = acquire(store, "a", ttl=5.0)
    again = acquire(store, "a", ttl=TTL, token=first.token)
    assert (again.token, again.epoch, again.holder) == (first.token, first.epoch, "a")
    assert again.lease_until > first.lease_until
    info = store.get_leader(KEY)
    assert info is not None and info.epoch == first.epoch


def test_expired_lease_is_taken_with_a_new_token_and_epoch_plus_one(store: Store) -> None:
    old = acquire(store, "a", ttl=SHORT)
    expire(store)
    new = acquire(store, "b")
    assert new.holder == "b" and new.epoch == old.epoch + 1 and new.token != old.token
    # The same holder coming back after expiry also starts a new term.
    store.release_leader(KEY, new.token)
    third = acquire(store, "b")
    assert third.epoch == new.epoch + 1 and third.token != new.token


def test_stale_token_never_extends_a_newer_term(store: Store) -> None:
    old = acquire(store, "a", ttl=SHORT)
    expire(store)
    newer = acquire(store, "b")
    assert store.try_acquire(KEY, "a", TTL, token=old.token) is None
    info = store.get_leader(KEY)
    assert info is not None and (info.holder, info.epoch) == ("b", newer.epoch)
    assert store.try_acquire(KEY, "b", TTL, token=newer.token) is not None


def test_release_only_by_token(store: Store) -> None:
    grant = acquire(store, "a")
    assert store.release_leader(KEY, "not-the-token") is False
    assert _alive(store)
    assert store.release_leader(KEY, grant.token) is True
    assert not _alive(store)
    # Released: the next candidate takes over at once, in a new term.
    new = acquire(store, "b")
    assert new.epoch == grant.epoch + 1
    # The old token can no longer release the new term.
    assert store.release_leader(KEY, grant.token) is False
    assert _alive(store)


def test_keys_are_independent(store: Store) -> None:
    acquire(store, "a")
    other = store.try_acquire("other", "b", TTL)
    assert other is not None and other.epoch == 1


def test_racing_candidates_exactly_one_wins(store: Store) -> None:
    """Four threads, each on its own engine, race for a key, free or expired: one wins."""
    handles = contextlib.ExitStack()
    stores = [handles.enter_context(other_handle(store)) for _ in range(4)]
    try:
        for r in range(8):
            key = f"race-{r}"
            expected_epoch = 1
            if r % 2:  # a failover race: the previous term just expired
                assert store.try_acquire(key, "old", SHORT) is not None
                wait_for(lambda key=key: not _alive(store, key), 10,
                         "the old term to expire")
                expected_epoch = 2
            barrier = threading.Barrier(len(stores))
            results: dict[int, LeaderGrant | None] = {}
            errors: list[BaseException] = []

            def run(i: int, key: str = key, barrier: threading.Barrier = barrier,
                    results: dict[int, LeaderGrant | None] = results,
                    errors: list[BaseException] = errors) -> None:
                try:
                    barrier.wait(5)
                    results[i] = stores[i].try_acquire(key, f"h{i}", TTL)
                except BaseException as exc:
                    errors.append(exc)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors
            winners = [g for g in results.values() if g is not None]
            assert len(results) == len(stores)
            assert len(winners) == 1, results
            assert winners[0].epoch == expected_epoch
            info = stores[0].get_leader(key)
            assert info is not None and (info.holder, info.epoch) == (winners[0].holder,
                                                                      expected_epoch)
    finally:
        handles.close()


# -- beat slots ---------------------------------------------------------------------
def test_fire_slot_records_once_per_entry_and_due_time(store: Store) -> None:
    g = acquire(store, "a")
    assert store.fire_slot(KEY, g.token, g.epoch, slot(100.0)) is True
    assert store.fire_slot(KEY, g.token, g.epoch, slot(100.0)) is False
    assert store.fire_slot(KEY, g.token, g.epoch, slot(100.0, entry="f")) is True
    rows = slot_rows(store)
    assert [(r.entry, r.due_at, r.leader_epoch) for r in rows] == [("e", 100.0, g.epoch),
                                                                   ("f", 100.0, g.epoch)]
    assert rows[0].task_id == slot_task_id("e", 100.0)
    assert rows[0].published_at is None


def test_fire_slot_advances_last_run_never_backwards(store: Store) -> None:
    g = acquire(store, "a")
    assert store.last_run() == {}
    store.fire_slot(KEY, g.token, g.epoch, slot(100.0))
    assert store.last_run() == {"e": 100.0}
    store.fire_slot(KEY, g.token, g.epoch, slot(120.0))
    assert store.last_run() == {"e": 120.0}
    store.fire_slot(KEY, g.token, g.epoch, slot(110.0))  # late catch-up of an older slot
    assert store.last_run() == {"e": 120.0}


def test_init_last_run_only_sets_a_missing_entry(store: Store) -> None:
    assert store.init_last_run("e", 50.0) == 50.0
    assert store.init_last_run("e", 70.0) == 50.0
    g = acquire(store, "a")
    store.fire_slot(KEY, g.token, g.epoch, slot(60.0))
    assert store.init_last_run("e", 10.0) == 60.0
    assert store.last_run() == {"e": 60.0}


def test_fire_slot_refused_after_the_term_expired(store: Store) -> None:
    g = acquire(store, "a", ttl=SHORT)
    store.init_last_run("e", 90.0)
    expire(store)
    # Nobody took over; the term is over by the store clock all the same.
    assert store.fire_slot(KEY, g.token, g.epoch, slot(100.0)) is False
    assert slot_rows(store) == []
    assert store.last_run() == {"e": 90.0}


def test_fire_slot_refused_after_release(store: Store) -> None:
    g = acquire(store, "a")
    store.release_leader(KEY, g.token)
    assert store.fire_slot(KEY, g.token, g.epoch, slot(100.0)) is False
    assert slot_rows(store) == []


def test_fire_slot_refused_with_a_stale_token_or_epoch(store: Store) -> None:
    old = acquire(store, "a", ttl=SHORT)
    expire(store)
    new = acquire(store, "b")
    assert store.fire_slot(KEY, old.token, old.epoch, slot(100.0)) is False
    assert store.fire_slot(KEY, old.token, new.epoch, slot(100.0)) is False
    assert store.fire_slot(KEY, new.token, old.epoch, slot(100.0)) is False
    assert store.fire_slot(KEY, "", new.epoch, slot(100.0)) is False
    assert store.fire_slot("other-key", new.token, new.epoch, slot(100.0)) is False
    assert slot_rows(store) == [] and store.last_run() == {}
    assert store.fire_slot(KEY, new.token, new.epoch, slot(100.0)) is True
    assert [r.leader_epoch for r in slot_rows(store)] == [new.epoch]


def test_a_slot_recorded_by_one_term_is_not_recorded_again_by_the_next(
        store: Store) -> None:
    # Long enough to fire its slot on a loaded machine (0.3 s was not, under CI's load on
    # MySQL), then waited out by the store clock.
    old = acquire(store, "a", ttl=2.0)
    assert store.fire_slot(KEY, old.token, old.epoch, slot(100.0)) is True
    expire(store)
    new = acquire(store, "b")
    assert store.fire_slot(KEY, new.token, new.epoch, slot(100.0)) is False
    assert [(r.due_at, r.leader_epoch) for r in slot_rows(store)] == [(100.0, old.epoch)]


def test_unpublished_slots_until_marked(store: Store) -> None:
    g = acquire(store, "a")
    for due in (300.0, 100.0, 200.0):
        store.fire_slot(KEY, g.token, g.epoch, slot(due))
    assert [s.due_at for s in store.unpublished_slots()] == [100.0, 200.0, 300.0]
    assert store.unpublished_slots()[0] == slot(100.0)  # same task id and payload
    assert len(store.unpublished_slots(limit=2)) == 2
    store.mark_slot_published("e", 200.0)
    assert [s.due_at for s in store.unpublished_slots()] == [100.0, 300.0]
    (row,) = [r for r in slot_rows(store) if r.due_at == 200.0]
    assert row.published_at is not None


def test_due_times_round_trip_exactly(store: Store) -> None:
    """Epoch-second due times with millisecond parts come back bit-identical (the key)."""
    g = acquire(store, "a")
    due = 1_712_345_678.123
    assert store.fire_slot(KEY, g.token, g.epoch, slot(due)) is True
    assert store.fire_slot(KEY, g.token, g.epoch, slot(due)) is False
    assert store.last_run() == {"e": due}
    assert store.unpublished_slots()[0].due_at == due
    store.mark_slot_published("e", due)
    assert store.unpublished_slots() == []


# -- dynamic schedule ---------------------------------------------------------------
def _row(name: str, every: float = 5.0, enabled: bool = True) -> ScheduleRow:
    return ScheduleRow(name, "proj.tick", "interval", f'{{"every": {every}}}', "[1]",
                       '{"k": 2}', "{}", enabled, 0.0)


def test_schedule_put_list_replace_pause_remove(store: Store) -> None:
    assert store.list_schedule() == []
    store.put_schedule(_row("b"))
    store.put_schedule(_row("a"))
    rows = store.list_schedule()
    assert [r.name for r in rows] == ["a", "b"]
    assert (rows[0].args, rows[0].kwargs, rows[0].enabled) == ("[1]", '{"k": 2}', True)
    assert rows[0].updated_at > 0
    store.put_schedule(_row("a", every=9.0))  # replace
    assert [r.spec for r in store.list_schedule() if r.name == "a"] == ['{"every": 9.0}']
    assert store.set_schedule_enabled("a", False) is True
    assert [r.enabled for r in store.list_schedule()] == [False, True]
    assert store.set_schedule_enabled("missing", True) is False
    assert store.remove_schedule("a") is True
    assert store.remove_schedule("a") is False
    assert [r.name for r in store.list_schedule()] == ["b"]


