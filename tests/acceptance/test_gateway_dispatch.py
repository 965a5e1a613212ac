"""Tasks through ``celery pulse gateway`` (issue 18): reserved in the store at receipt,
assigned within the worker's capacity, started, renewed and finished under the store's
fences; a lost lease makes a late finish evidence only; a reconnect resumes.

A real gateway process on TLS, RabbitMQ and a PostgreSQL store; tasks published by a
plain Celery client; the worker's side spoken in raw frames (what any pulse.worker.v1
client sends), so each rule of the protocol is asserted as sent and received.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult
from websockets.exceptions import InvalidMessage

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import GatewayProcess, Peer, claim_of, hello_body
from tests.helpers.workers import Env, wait_for

TTL = 3.0


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {
        "result_backend": "pulse://", "pulse_lease_ttl": TTL, "pulse_recover_interval": 0.5,
        "task_default_queue": "unused"})
    made.app = "tests.apps.opsapp"
    return made


def _publish(client: Celery, env: Env, name: str = "opsapp.noop") -> str:
    task_id: str = client.send_task(name, queue=env.queue).id
    return task_id


def _worker(open_peer: Callable[..., Peer], env: Env, capacity: int,
            hello: dict[str, Any] | None = None) -> Peer:
    peer = open_peer()
    welcome = peer.call("worker.hello", hello or hello_body(queue=env.queue, capacity=capacity),
                        session_id=None)
    assert welcome["type"] == "worker.welcome", welcome
    peer.session_id = welcome["body"]["session_id"]
    assert peer.call("worker.capacity", {"sequence": "1", "capacity": capacity,
                                         "drain": False})["type"] == "ack"
    return peer


def _try_worker(open_peer: Callable[..., Peer], env: Env, capacity: int) -> Peer | None:
    try:
        return _worker(open_peer, env, capacity)
    except (InvalidMessage, OSError, TimeoutError):
        return None


def _ref(assign: dict[str, Any]) -> dict[str, str]:
    body = assign["body"]
    return {k: body[k] for k in ("task_id", "attempt_id", "epoch", "lease_secret")}


def test_a_task_runs_through_the_gateway(env: Env, client_app: Celery, gateway_store: SqlStore,
                                         open_peer: Callable[..., Peer]) -> None:
    peer = _worker(open_peer, env, capacity=2)
    task_id = _publish(client_app, env)
    assign = peer.assignment()
    body = assign["body"]
    assert assign.get("reply_to") is None and assign["session_id"] == peer.session_id
    assert body["task"]["id"] == task_id and body["task"]["name"] == "opsapp.noop"
    assert body["task_id"] == task_id.replace("-", "") and body["epoch"] == "1"
    assert body["server_time"] < body["lease_until"]
    # Reserved in the store before the broker was acknowledged: the claim row owns it.
    claim = claim_of(gateway_store, task_id)
    assert claim.state == "reserved" and claim.holder.startswith("gw:runner:")

    started = peer.call("task.start", _ref(assign))
    assert started["type"] == "ack", started
    assert started["body"]["receipt"]["disposition"] == "APPLIED"
    assert started["body"]["lease"]["active"] is True
    assert started["body"]["lease"]["state"] == "RUNNING"
    assert claim_of(gateway_store, task_id).state == "running"
    renewed = peer.call("task.renew", _ref(assign))
    assert renewed["body"]["receipt"]["operation"] == "renew"
    assert renewed["body"]["lease"]["active"] is True

    finish = {"ref": _ref(assign), "outcome": "SUCCEEDED", "result": {"answer": 42}}
    finish_id = secrets.token_hex(16)
    done = peer.call("task.finish", finish, message_id=finish_id)
    assert done["body"]["receipt"]["disposition"] == "APPLIED", done
    assert done["body"]["lease"]["active"] is False
    assert claim_of(gateway_store, task_id).state == "succeeded"
    assert AsyncResult(task_id, app=client_app).get(timeout=10) == {"answer": 42}
    # The finish again (its ACK lost, say): the original receipt, deduplicated.
    again = peer.call("task.finish", finish, message_id=finish_id)
    assert again["body"]["deduplicated"] is True
    assert again["body"]["receipt"] == done["body"]["receipt"]
    # A finished attempt can't start or renew again.
    assert peer.error("task.renew", _ref(assign)) == "LEASE_LOST"
    # A forged secret names no attempt.
    assert peer.error("task.start", {**_ref(assign), "lease_secret": "forged"}) == "NOT_FOUND"


def test_dispatch_is_paced_to_the_rate_the_gateway_was_given(
        env: Env, client_app: Celery, start_gateway: Callable[..., GatewayProcess],
        open_peer: Callable[..., Peer]) -> None:
    """``--dispatch-rate 4`` (the seed's baseline): one dispatch round per 0.25 s per
    instance. A worker of capacity 1 that finishes each task at once still gets the next
    one no sooner than a round later (a lower bound: load only lengthens the gaps)."""
    paced = start_gateway("--dispatch-rate", "4")
    peer = open_peer(url=paced.url)
    welcome = peer.call("worker.hello", hello_body(queue=env.queue, capacity=1),
                        session_id=None)
    peer.session_id = welcome["body"]["session_id"]
    for _ in range(6):
        _publish(client_app, env)
    assert peer.call("worker.capacity", {"sequence": "1", "capacity": 1,
                                         "drain": False})["type"] == "ack"
    received = []
    for _ in range(6):
        assign = peer.assignment()
        received.append(time.monotonic())
        assert peer.call("task.start", _ref(assign))["type"] == "ack"
        done = peer.call("task.finish", {"ref": _ref(assign), "outcome": "SUCCEEDED",
                                         "result": 0})
        assert done["body"]["receipt"]["disposition"] == "APPLIED"
    gaps = [b - a for a, b in itertools.pairwise(received)]
    assert min(gaps) >= 0.2, gaps  # 0.25 s apart when sent, less the network's jitter


def test_dispatch_stays_within_the_declared_capacity(
        env: Env, client_app: Celery, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    peer = _worker(open_peer, env, capacity=1)
    ids = [_publish(client_app, env) for _ in range(3)]
    first = peer.assignment()
    with pytest.raises(TimeoutError):
        peer.assignment(timeout=2)  # one slot, one attempt held
    reserved = [c for c in gateway_store.list_claims() if c.task_id in ids]
    assert len(reserved) == 1  # the others stay with the broker
    assert peer.call("task.start", _ref(first))["type"] == "ack"
    assert peer.call("task.finish", {"ref": _ref(first), "outcome": "FAILED",
                                     "result": {"why": "no"}, "error_code": "E_NO"}
                     )["body"]["receipt"]["disposition"] == "APPLIED"
    assert claim_of(gateway_store, first["body"]["task"]["id"]).state == "failed"
    second = peer.assignment()
    assert second["body"]["task"]["id"] != first["body"]["task"]["id"]
    # Draining: nothing more is assigned; the last task stays in the broker.
    assert peer.call("worker.capacity", {"sequence": "2", "capacity": 1, "drain": True}
                     )["body"]["draining"] is True
    assert peer.call("task.start", _ref(second))["type"] == "ack"
    assert peer.call("task.finish", {"ref": _ref(second), "outcome": "SUCCEEDED",
                                     "result": 1})["type"] == "ack"
    with pytest.raises(TimeoutError):
        peer.assignment(timeout=2)
    assert len([c for c in gateway_store.list_claims() if c.task_id in ids]) == 2


def test_a_lost_lease_makes_the_late_finish_evidence_only(
        env: Env, client_app: Celery, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    peer = _worker(open_peer, env, capacity=1)
    task_id = _publish(client_app, env)
    assign = peer.assignment()
    assert peer.call("task.start", _ref(assign))["body"]["lease"]["active"] is True
    # No renewal: the lease expires by the store clock and the gateway's Recover takes
    # the claim (started, not idempotent: needs review).
    wait_for(lambda: claim_of(gateway_store, task_id).state == "needs_review", 30,
             "Recover to send the started task to review")
    late = peer.call("task.finish", {"ref": _ref(assign), "outcome": "SUCCEEDED",
                                     "result": "late"})
    assert late["body"]["receipt"]["disposition"] == "EVIDENCE_ONLY", late
    assert late["body"]["lease"]["active"] is False
    assert claim_of(gateway_store, task_id).state == "needs_review"  # the store's verdict stands
    with gateway_store.engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT holder, outcome FROM pulse_evidence WHERE task_id = :t"), {"t": task_id}
        ).all()
    assert [(r.holder.startswith("gw:runner:"), r.outcome) for r in rows] == [
        (True, "succeeded")]
    assert AsyncResult(task_id, app=client_app).state == "PENDING"  # no stale result written


def test_a_store_operation_past_its_limit_is_cancelled_in_the_store(
        env: Env, client_app: Celery, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    """Seed 003 §6: one store operation may take 8 s. Past it the worker is answered
    UNAVAILABLE, and the statement itself is cancelled by the server (the gateway's
    sessions carry ``statement_timeout``): nothing of it still waits on the lock that held
    it, to apply later behind the worker's back."""
    peer = _worker(open_peer, env, capacity=1)
    task_id = _publish(client_app, env)
    assign = peer.assignment()
    holder = gateway_store.engine.connect()
    try:
        # This test's lock is held on purpose, idle in its transaction: past the store's
        # own idle cap, for this transaction only.
        holder.execute(sa.text("SET LOCAL idle_in_transaction_session_timeout = 0"))
        holder.execute(sa.text("SELECT 1 FROM pulse_claims WHERE task_id = :t FOR UPDATE"),
                       {"t": task_id})
        started = time.monotonic()
        refused = peer.error("task.start", _ref(assign))
        assert refused == "UNAVAILABLE"
        assert 7.0 < time.monotonic() - started < 12.0

        def waiting() -> int:
            with gateway_store.engine.connect() as conn:
                return int(conn.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE "
                    "'pulse:gateway:%' AND wait_event_type = 'Lock'")).scalar_one())
        wait_for(lambda: waiting() == 0, 5, "the gateway's statement to be cancelled")
    finally:
        holder.rollback()
        holder.close()


def test_a_reservation_never_started_is_dispatched_again(
        env: Env, client_app: Celery, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    peer = _worker(open_peer, env, capacity=2)
    task_id = _publish(client_app, env)
    first = peer.assignment()
    # Never started: once the lease expires, Recover re-publishes it and it comes back
    # under a new epoch and a new attempt id; the old attempt can no longer start.
    again = peer.assignment(timeout=30)
    assert again["body"]["task"]["id"] == task_id
    assert int(again["body"]["epoch"]) > int(first["body"]["epoch"])
    assert again["body"]["attempt_id"] != first["body"]["attempt_id"]
    assert peer.error("task.start", _ref(first)) == "LEASE_LOST"
    assert peer.call("task.start", _ref(again))["type"] == "ack"


def test_a_reconnect_resumes_a_running_attempt_and_finishes_it_once(
        env: Env, client_app: Celery, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    hello = hello_body(queue=env.queue, capacity=1)
    peer = _worker(open_peer, env, capacity=1, hello=hello)
    task_id = _publish(client_app, env)
    assign = peer.assignment()
    assert peer.call("task.start", _ref(assign))["type"] == "ack"
    # The finish is sent, then the connection drops before its ACK is read.
    finish = {"ref": _ref(assign), "outcome": "SUCCEEDED", "result": "once"}
    finish_id = peer.send("task.finish", finish)
    peer.conn.close()
    back = open_peer()
    welcome = back.call("worker.hello", hello, session_id=None)
    assert welcome["body"]["epoch"] == "2"
    back.session_id = welcome["body"]["session_id"]
    resumed = back.call("worker.resume", _ref(assign))
    assert resumed["type"] in ("ack", "error"), resumed
    # Whether the first finish reached the store or not, the re-sent one (same
    # message_id) settles it once.
    settled = back.call("task.finish", finish, message_id=finish_id)
    assert settled["type"] == "ack", settled
    assert settled["body"]["receipt"]["disposition"] == "APPLIED"
    assert claim_of(gateway_store, task_id).state == "succeeded"
    assert AsyncResult(task_id, app=client_app).get(timeout=10) == "once"
    with gateway_store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM pulse_evidence WHERE task_id = :t"),
                            {"t": task_id}).scalar_one() == 0


def test_resume_reports_the_lease_without_extending_it(
        env: Env, client_app: Celery, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    hello = hello_body(queue=env.queue, capacity=1)
    peer = _worker(open_peer, env, capacity=1, hello=hello)
    _publish(client_app, env)
    assign = peer.assignment()
    started = peer.call("task.start", _ref(assign))
    peer.conn.close()
    back = open_peer()
    welcome = back.call("worker.hello", hello, session_id=None)
    back.session_id = welcome["body"]["session_id"]
    resumed = back.call("worker.resume", _ref(assign))
    assert resumed["type"] == "ack", resumed
    lease = resumed["body"]["lease"]
    assert lease["active"] is True and lease["state"] == "RUNNING"
    # The same lease the start granted: a resume moves nothing and extends nothing.
    assert lease["lease_until"] == started["body"]["lease"]["lease_until"]
    renewed = back.call("task.renew", _ref(assign))["body"]["lease"]
    assert renewed["active"] is True and renewed["lease_until"] > lease["lease_until"]


def test_gateway_workers_are_listed_beside_direct_ones(
        env: Env, gateway_store: SqlStore, open_peer: Callable[..., Peer]) -> None:
    # A direct worker's registration, as a -P pulse worker makes it (no "via" label).
    gateway_store.register("direct@host", {"pool": "pulse", "queues": [env.queue]}, 60.0)
    hello = hello_body(queue=env.queue, capacity=3)
    name = f"gw:runner:{hello['instance_id']}"

    def listed() -> dict[str, Any]:
        return {w["id"]: w for w in env.celery_json("pulse", "workers")}

    peer = _worker(open_peer, env, capacity=3, hello=hello)
    row = wait_for(lambda: listed().get(name), 20, "the gateway worker to be registered")
    assert row["alive"] is True and row["draining"] is False and row["via"] == "gateway"
    assert {k: row["labels"][k] for k in ("via", "credential", "queue", "capacity")} == {
        "via": "gateway", "credential": "runner", "queue": env.queue, "capacity": 3}
    assert re.fullmatch(r".+:\d+", row["labels"]["gateway"])  # which gateway: host:pid
    assert listed()["direct@host"]["via"] == "direct"
    status = json.loads(env.celery("pulse", "status", "--json").stdout)
    assert {w["id"]: w["via"] for w in status["workers"]} == {
        "direct@host": "direct", name: "gateway"}
    lines = env.celery("pulse", "workers").stdout.splitlines()
    assert lines[0].split()[:3] == ["WORKER", "VIA", "ALIVE"]
    [gw_line] = [ln for ln in lines if ln.startswith(name)]
    assert gw_line.split()[1] == "gateway" and f"queue={env.queue}" in gw_line
    [direct_line] = [ln for ln in lines if ln.startswith("direct@host")]
    assert direct_line.split()[1] == "direct"

    # A reconnect registers the instance again (a new registration of the same name);
    # the replaced connection ending doesn't take it away.
    back = open_peer()
    welcome = back.call("worker.hello", hello, session_id=None)
    back.session_id = welcome["body"]["session_id"]
    assert peer.closed_with() == 1008
    wait_for(lambda: listed().get(name, row)["registered_at"] > row["registered_at"], 20,
             "the reconnected instance to be registered again")

    # drain=true is the registry's drain of its name: shown while it is still alive.
    assert back.call("worker.capacity", {"sequence": "2", "capacity": 3, "drain": True}
                     )["body"]["draining"] is True
    drained = wait_for(lambda: (w := listed().get(name)) and w["draining"] and w, 20,
                       "the gateway worker to show as draining")
    assert drained["alive"] is True
    assert "[draining]" in next(ln for ln in env.celery("pulse", "workers").stdout
                                .splitlines() if ln.startswith(name))

    # Its last connection closes: deregistered at once (not left to expire).
    back.conn.close()
    wait_for(lambda: name not in listed(), 20, "the gateway worker to be deregistered")
    assert "direct@host" in listed()


def test_a_slow_consumer_is_disconnected_and_loses_nothing(
        env: Env, client_app: Celery, gateway_store: SqlStore, gateway: GatewayProcess,
        open_peer: Callable[..., Peer]) -> None:
    """A worker that stops reading: its gateway's writes block, the write deadline (5 s)
    ends the connection; what the gateway reserved for it is in the store, expires and
    is re-dispatched: another worker receives every task."""
    # ~400 KB a frame: past the client's read queue and the socket buffers (a few MB on
    # loopback) the gateway's writes block.
    count, pad = 24, "x" * 300_000
    slow = _worker(open_peer, env, capacity=count)
    ids = {client_app.send_task("opsapp.noop", (pad,), queue=env.queue).id for _ in range(count)}
    wait_for(lambda: "write did not complete" in gateway.log(), 60,
             "the gateway to drop the worker that doesn't read")
    del slow  # never read from: closed by its fixture
    # A worker connecting while the gateway is busy tearing that one down may meet a
    # handshake that times out: it connects again, as any client would.
    fast = wait_for(lambda: _try_worker(open_peer, env, count), 60, "a second worker to join")
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while seen != ids and time.monotonic() < deadline:
        assign = fast.assignment(timeout=max(0.1, deadline - time.monotonic()))
        seen.add(assign["body"]["task"]["id"])
    assert seen == ids


def test_flower_sees_gateway_workers_through_the_gateways_events(
        env: Env, client_app: Celery, open_peer: Callable[..., Peer]) -> None:
    """Celery events, sent by the gateway for its workers (what Flower and ``celery
    events`` read): online/offline under the holder name, task started and succeeded."""
    events: list[dict[str, Any]] = []
    ready, stop = threading.Event(), threading.Event()

    def listen() -> None:
        with client_app.connection_for_read() as conn:
            receiver = client_app.events.Receiver(conn, handlers={"*": events.append})
            receiver.on_consume_ready = lambda *_a, **_k: ready.set()
            receiver.should_stop = False
            threading.Thread(target=lambda: (stop.wait(), setattr(
                receiver, "should_stop", True)), daemon=True).start()
            receiver.capture(limit=None, timeout=None, wakeup=False)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert ready.wait(15), "the event receiver did not start"
    try:
        peer = _worker(open_peer, env, capacity=1)
        task_id = _publish(client_app, env)
        assign = peer.assignment()
        assert peer.call("task.start", _ref(assign))["type"] == "ack"
        assert peer.call("task.finish", {"ref": _ref(assign), "outcome": "SUCCEEDED",
                                         "result": 1})["type"] == "ack"
        peer.conn.close()

        def seen(kind: str, **match: Any) -> bool:
            return any(e["type"] == kind and all(e.get(k) == v for k, v in match.items())
                       for e in list(events))
        wait_for(lambda: seen("worker-online"), 15, "worker-online")
        [online] = [e for e in events if e["type"] == "worker-online"]
        holder = online["hostname"]
        assert holder.startswith("gw:runner:")
        wait_for(lambda: seen("task-started", uuid=task_id, hostname=holder), 15,
                 "task-started")
        wait_for(lambda: seen("task-succeeded", uuid=task_id, hostname=holder), 15,
                 "task-succeeded")
        wait_for(lambda: seen("worker-offline", hostname=holder), 15, "worker-offline")
        # Task events go out buffered (one task.multi message), the worker's at once: what
        # was buffered before the offline goes first.
        kinds = [e["type"] for e in list(events) if e.get("hostname") == holder]
        assert kinds.index("task-succeeded") < kinds.index("worker-offline"), kinds
    finally:
        stop.set()
        listener.join(10)
