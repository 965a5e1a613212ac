"""The gateway's shared state (issue 37), on the in-memory store and every SQL store:
sessions open generation after generation wherever a hello lands, a reconnect keeps its
identity, only the current generation declares capacity, and attempts are found by id
(with the claim's state) by any gateway process.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from celery_pulse.store.base import Store
from celery_pulse.store.credentials import digest
from celery_pulse.store.gateway_state import AttemptRecord, IdentityChanged, identity_digest
from tests.contract.test_claims_contract import TTL, grant, request

GATEWAY = "gw-a"
HOLDER = "gw:runner:" + "a" * 32


def _instance(store: Store) -> str:
    instance_id = uuid.uuid4().hex
    assert store.credentials.bind_instance(instance_id, uuid.uuid4().hex, "secret")
    return instance_id


def _record(instance_id: str, task_id: str, epoch: int, token: str) -> AttemptRecord:
    return AttemptRecord(uuid.uuid4().hex, instance_id, task_id, uuid.uuid4().hex, epoch,
                         digest(token), "proj.add")


def test_each_hello_opens_the_next_generation(store: Store) -> None:
    state, instance_id = store.gateway_state, _instance(store)
    identity = identity_digest("q1", [{"handler": "a"}])
    first = state.open_session(instance_id, "s1", GATEWAY, identity)
    second = state.open_session(instance_id, "s2", "gw-b", identity)
    assert (first.generation, second.generation) == (1, 2)
    assert state.generations([instance_id, uuid.uuid4().hex]) == {instance_id: 2}
    assert state.generations([]) == {}


def test_a_reconnect_must_keep_its_identity(store: Store) -> None:
    state, instance_id = store.gateway_state, _instance(store)
    state.open_session(instance_id, "s1", GATEWAY, identity_digest("q1", ["a", "b"]))
    # The capabilities in another order are the same identity.
    assert state.open_session(instance_id, "s2", GATEWAY,
                              identity_digest("q1", ["b", "a"])).generation == 2
    with pytest.raises(IdentityChanged):
        state.open_session(instance_id, "s3", GATEWAY, identity_digest("q2", ["a", "b"]))
    assert state.generations([instance_id]) == {instance_id: 2}  # nothing moved


def test_simultaneous_hellos_get_distinct_generations(store: Store) -> None:
    state, instance_id = store.gateway_state, _instance(store)
    identity = identity_digest("q1", [])
    got: list[int] = []
    lock = threading.Lock()

    def hello(n: int) -> None:
        opened = state.open_session(instance_id, f"s{n}", GATEWAY, identity)
        with lock:
            got.append(opened.generation)

    threads = [threading.Thread(target=hello, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [1, 2, 3, 4, 5, 6]


def test_only_the_current_generation_declares_and_the_next_session_reads_it(
        store: Store) -> None:
    state, instance_id = store.gateway_state, _instance(store)
    identity = identity_digest("q1", [])
    first = state.open_session(instance_id, "s1", GATEWAY, identity)
    assert (first.capacity_sequence, first.capacity, first.drain) == (-1, 0, False)
    assert state.declare(instance_id, first.generation, 3, 4, True)
    second = state.open_session(instance_id, "s2", "gw-b", identity)
    assert (second.capacity_sequence, second.capacity, second.drain) == (3, 4, True)
    assert not state.declare(instance_id, first.generation, 4, 8, False)  # replaced
    assert state.open_session(instance_id, "s3", GATEWAY, identity).capacity == 4


def test_attempts_are_found_by_id_and_live_ones_counted_with_their_state(
        store: Store) -> None:
    state, instance_id = store.gateway_state, _instance(store)
    running, reserved, done = (grant(store, HOLDER, request()) for _ in range(3))
    assert store.start_many(HOLDER, [(running.task_id, running.epoch, running.token)], TTL)
    assert store.start_many(HOLDER, [(done.task_id, done.epoch, done.token)], TTL)
    from celery_pulse.store.base import SUCCEEDED, Completion
    store.complete(HOLDER, [Completion(done.task_id, done.epoch, done.token, SUCCEEDED,
                                       None)])
    records = {g.task_id: _record(instance_id, g.task_id, g.epoch, g.token)
               for g in (running, reserved, done)}
    for record in records.values():
        state.record_attempts([record])
    found = state.find_attempt(records[running.task_id].attempt_id)
    assert found == records[running.task_id]
    assert state.find_attempt(uuid.uuid4().hex) is None
    [(shown, assigned_at)] = state.attempts_of(running.task_id)
    assert shown == records[running.task_id]
    assert assigned_at == pytest.approx(store.now(), abs=30)
    assert state.attempts_of("no-such-task") == []
    live = {r.task_id: s for r, s in state.live_attempts(instance_id, HOLDER)}
    assert live == {running.task_id: "running", reserved.task_id: "reserved"}
    assert state.live_attempts(instance_id, "someone-else") == []
    assert state.live_attempts(uuid.uuid4().hex, HOLDER) == []


def test_the_purge_keeps_attempts_whose_claims_still_run(store: Store) -> None:
    state, instance_id = store.gateway_state, _instance(store)
    running, done = grant(store, HOLDER, request()), grant(store, HOLDER, request())
    from celery_pulse.store.base import SUCCEEDED, Completion
    store.start_many(HOLDER, [(done.task_id, done.epoch, done.token)], TTL)
    store.complete(HOLDER, [Completion(done.task_id, done.epoch, done.token, SUCCEEDED, None)])
    kept = _record(instance_id, running.task_id, running.epoch, running.token)
    gone = _record(instance_id, done.task_id, done.epoch, done.token)
    state.record_attempts([kept])
    state.record_attempts([gone])
    assert state.purge_attempts(store.now() - 3600) == 0  # none old enough
    assert state.purge_attempts(store.now() + 1) == 1
    assert state.find_attempt(kept.attempt_id) == kept
    assert state.find_attempt(gone.attempt_id) is None
