"""The gateway credentials contract (issue 18), on the in-memory store and every SQL store.

A token authenticates only while its credential exists, is not revoked and the secret
matches; every failure is the same :class:`Unauthenticated`. The store holds the
secret's digest, never the secret or the token. Names are unique (revoked ones too),
scopes known, consuming needs queues; revocation is by name or id and idempotent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig, NotFound, PulseError
from celery_pulse.gateway.credentials import (
    CONNECT,
    CONSUME,
    PREFIX,
    SCOPES,
    Credential,
    CredentialStore,
    Forbidden,
    Unauthenticated,
    digest,
    mint,
    parse_token,
)
from celery_pulse.store.base import Store
from celery_pulse.store.memory import MemoryStore
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.credentials import SqlCredentials
from celery_pulse.store.sql.tables import credentials as credentials_table
from celery_pulse.store.sql.tables import gateway_instances

BOTH = (CONNECT, CONSUME)


@dataclasses.dataclass
class Subject:
    """A credential store with its store clock and a dump of everything it keeps."""

    store: CredentialStore
    now: Callable[[], float]
    dump: Callable[[], str]


@pytest.fixture
def subject(store: Store) -> Subject:
    """The credentials of the contract fixture's store (memory or SQL), on its clock."""
    if isinstance(store, MemoryStore):
        memory = store.credentials
        return Subject(memory, store.now, lambda: repr((memory._rows, memory._instances)))
    assert isinstance(store, SqlStore) and isinstance(store.credentials, SqlCredentials)

    def dump() -> str:
        with store.engine.connect() as conn:
            return json.dumps([[list(map(str, row)) for row in conn.execute(
                sa.select(table))] for table in (credentials_table, gateway_instances)])

    return Subject(store.credentials, store.now, dump)


def _unauthenticated(store: CredentialStore, token: Any) -> str:
    with pytest.raises(Unauthenticated) as info:
        store.authenticate(token)
    return str(info.value)


# -- tokens (pure) ------------------------------------------------------------------------
def test_minted_tokens_have_the_documented_shape() -> None:
    credential_id, secret, token = mint()
    assert token == f"{PREFIX}{credential_id}_{secret}"
    assert len(credential_id) == 32 and credential_id == credential_id.lower()
    int(credential_id, 16)
    assert len(secret) == 43 and "=" not in secret
    assert parse_token(token) == (credential_id, secret)
    assert digest(secret) == hashlib.sha256(secret.encode()).hexdigest()
    assert len({mint()[1] for _ in range(50)}) == 50


@pytest.mark.parametrize("bad", [
    "", PREFIX, "pgw2_" + "a" * 32 + "_" + "A" * 43, PREFIX + "A" * 32 + "_" + "A" * 43,
    PREFIX + "a" * 31 + "_" + "A" * 44, PREFIX + "a" * 32 + "_" + "A" * 42,
    PREFIX + "a" * 32 + "_" + "A" * 43 + "\n", " " + PREFIX + "a" * 32 + "_" + "A" * 42,
    PREFIX + "a" * 32 + "_" + "A" * 42 + "=", PREFIX + "a" * 32 + "_" + "A" * 42 + "!",
    PREFIX + "a" * 32 + "-" + "A" * 43, PREFIX + "a" * 32 + "_" + "A" * 42 + "é",
    # the last character carries 2 spare bits: only "A", "Q", "g", "w" leave them zero
    PREFIX + "a" * 32 + "_" + "A" * 42 + "B",
    None, b"pgw1_", 42,
])
def test_parse_token_refuses_malformed_input(bad: Any) -> None:
    with pytest.raises(Unauthenticated):
        parse_token(bad)


def test_parse_token_takes_every_canonical_last_character() -> None:
    for last in "AQgw":
        parse_token(PREFIX + "a" * 32 + "_" + "A" * 42 + last)


# -- the store contract -------------------------------------------------------------------
def test_create_then_authenticate_round_trip(subject: Subject) -> None:
    before = subject.now()
    record, token = subject.store.create_credential("runner-1", BOTH, ["b", "a", "b"],
                                                    "alice@host")
    after = subject.now()
    assert record.name == "runner-1"
    assert record.scopes == SCOPES
    assert record.queues == ("a", "b")
    assert record.created_by == "alice@host"
    assert before <= record.created_at <= after
    assert record.active and record.revoked_at is None and record.revoked_by is None
    assert parse_token(token)[0] == record.credential_id
    assert subject.store.authenticate(token) == record
    assert subject.store.get_credential(record.credential_id) == record
    assert subject.store.get_credential("f" * 32) is None
    assert subject.store.get_credential("runner-1") is None  # ids only


def test_every_failure_is_the_same_unauthenticated(subject: Subject) -> None:
    record, token = subject.store.create_credential("runner", BOTH, ["q"], "op")
    _, other_secret, _ = mint()
    credential_id, secret = parse_token(token)
    messages = {
        "wrong secret": _unauthenticated(subject.store,
                                         f"{PREFIX}{credential_id}_{other_secret}"),
        "malformed": _unauthenticated(subject.store, token[:-1]),
        "not a string": _unauthenticated(subject.store, None),
        "unknown id": _unauthenticated(subject.store, f"{PREFIX}{'0' * 32}_{secret}"),
    }
    assert subject.store.authenticate(token) == record  # none of that harmed it
    subject.store.revoke_credential("runner", "op")
    messages["revoked"] = _unauthenticated(subject.store, token)
    assert set(messages.values()) == {"The credential is unknown, malformed or revoked."}
    for message in messages.values():
        assert secret not in message and credential_id not in message


def test_the_digest_is_stored_never_the_secret(subject: Subject) -> None:
    _, token = subject.store.create_credential("runner", BOTH, ["q"], "op")
    _, secret = parse_token(token)
    kept = subject.dump()
    assert digest(secret) in kept
    assert secret not in kept and token not in kept
    for record in subject.store.list_credentials():
        assert secret not in repr(record)


def test_a_name_is_taken_once_even_once_revoked(subject: Subject) -> None:
    first, token = subject.store.create_credential("runner", BOTH, ["q"], "op")
    with pytest.raises(InvalidConfig, match="'runner' already exists"):
        subject.store.create_credential("runner", [CONNECT], [], "op")
    assert subject.store.authenticate(token) == first
    subject.store.revoke_credential("runner", "op")
    with pytest.raises(InvalidConfig, match="already exists"):
        subject.store.create_credential("runner", BOTH, ["q"], "op")
    assert [c.credential_id for c in subject.store.list_credentials()] == [first.credential_id]
    assert subject.store.create_credential("Runner", BOTH, ["q"], "op")[0].name == "Runner"


def test_concurrent_creates_of_one_name_give_one_credential(subject: Subject) -> None:
    barrier = threading.Barrier(4)
    outcomes: list[Credential | PulseError] = []

    def create() -> None:
        barrier.wait()
        try:
            outcomes.append(subject.store.create_credential("race", BOTH, ["q"], "op")[0])
        except PulseError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    made = [o for o in outcomes if isinstance(o, Credential)]
    refused = [o for o in outcomes if not isinstance(o, Credential)]
    assert len(made) == 1, outcomes
    assert len(refused) == 3 and all(isinstance(o, InvalidConfig) and "already exists" in
                                     str(o) for o in refused), outcomes
    assert subject.store.list_credentials() == made


@pytest.mark.parametrize(("name", "scopes", "queues", "says"), [
    ("r", ["workers:admin"], ["q"], "unknown scope"),
    ("r", [], ["q"], "at least one scope"),
    ("r", [CONSUME], [], "needs at least one queue"),
    ("r", BOTH, [""], "invalid queue"),
    ("r", BOTH, ["a\nb"], "invalid queue"),
    ("r", BOTH, ["q" * 256], "invalid queue"),
    ("", BOTH, ["q"], "invalid credential name"),
    ("has space", BOTH, ["q"], "invalid credential name"),
    ("-dash", BOTH, ["q"], "invalid credential name"),
    ("n" * 256, BOTH, ["q"], "invalid credential name"),
    ("0123456789abcdef0123456789abcdef", BOTH, ["q"], "would read as a credential id"),
])
def test_invalid_credentials_are_refused(subject: Subject, name: str, scopes: list[str],
                                         queues: list[str], says: str) -> None:
    with pytest.raises(InvalidConfig, match=says):
        subject.store.create_credential(name, scopes, queues, "op")
    assert subject.store.list_credentials() == []


def test_connect_alone_needs_no_queue(subject: Subject) -> None:
    record, token = subject.store.create_credential("watcher", [CONNECT], [], "op")
    assert record.scopes == {CONNECT} and record.queues == ()
    assert subject.store.authenticate(token).allows(CONNECT)


def test_revoke_by_name_or_id_is_idempotent(subject: Subject) -> None:
    a, token_a = subject.store.create_credential("a", BOTH, ["q"], "op")
    b, token_b = subject.store.create_credential("b", BOTH, ["q"], "op")
    before = subject.now()
    revoked = subject.store.revoke_credential("a", "bob@host")
    assert revoked.credential_id == a.credential_id and not revoked.active
    assert revoked.revoked_by == "bob@host"
    assert revoked.revoked_at is not None and before <= revoked.revoked_at <= subject.now()
    assert dataclasses.replace(revoked, revoked_at=None, revoked_by=None) == a
    assert subject.store.revoke_credential(a.credential_id, "carol@host") == revoked
    assert subject.store.revoke_credential("a", "carol@host") == revoked
    assert subject.store.get_credential(a.credential_id) == revoked
    _unauthenticated(subject.store, token_a)
    assert subject.store.authenticate(token_b) == b  # only the one named
    by_id = subject.store.revoke_credential(b.credential_id, "op")
    assert by_id.name == "b" and not by_id.active
    _unauthenticated(subject.store, token_b)


def test_revoking_what_does_not_exist_is_not_found(subject: Subject) -> None:
    with pytest.raises(NotFound, match="'nobody'"):
        subject.store.revoke_credential("nobody", "op")
    with pytest.raises(NotFound):
        subject.store.revoke_credential("e" * 32, "op")


def test_list_shows_revoked_ones_by_name(subject: Subject) -> None:
    for name in ("c", "a", "b"):
        subject.store.create_credential(name, BOTH, ["q"], "op")
    subject.store.revoke_credential("b", "op")
    listed = subject.store.list_credentials()
    assert [(c.name, c.active) for c in listed] == [("a", True), ("b", False), ("c", True)]
    assert [c.name for c in subject.store.list_credentials(include_revoked=False)] == ["a", "c"]
    assert not any(hasattr(c, "secret_digest") for c in listed)


# -- authorisation (pure) -----------------------------------------------------------------
def _credential(scopes: frozenset[str], queues: tuple[str, ...],
                revoked: bool = False) -> Credential:
    return Credential("a" * 32, "n", scopes, queues, 1.0, "op",
                      2.0 if revoked else None, "op" if revoked else None)


def test_allows_and_require_check_scope_and_queue() -> None:
    both = _credential(SCOPES, ("a", "b"))
    assert both.allows(CONNECT) and both.allows(CONSUME) and both.allows(CONSUME, "b")
    assert not both.allows(CONSUME, "c")
    both.require(CONSUME, "a")
    with pytest.raises(Forbidden, match="may not consume queue 'c'"):
        both.require(CONSUME, "c")
    connect = _credential(frozenset({CONNECT}), ())
    connect.require(CONNECT)
    assert not connect.allows(CONSUME) and not connect.allows(CONSUME, "a")
    with pytest.raises(Forbidden, match="does not grant workers:consume"):
        connect.require(CONSUME, "a")
    assert not connect.allows("workers:admin")


def test_a_revoked_credential_allows_nothing() -> None:
    revoked = _credential(SCOPES, ("a",), revoked=True)
    assert not revoked.active
    assert not revoked.allows(CONNECT) and not revoked.allows(CONSUME, "a")
    with pytest.raises(Unauthenticated):
        revoked.require(CONNECT)


# -- gateway instances and their owner ------------------------------------------------------
def _instance_secret() -> str:
    return mint()[1]  # 43 characters of base64url, as an instance secret is


def test_an_instance_belongs_to_the_credential_and_secret_of_its_first_hello(
        subject: Subject) -> None:
    owner, _ = subject.store.create_credential("q1-runner", BOTH, ["q1"], "op")
    other, _ = subject.store.create_credential("q2-runner", BOTH, ["q2"], "op")
    instance, secret = "ab" * 16, _instance_secret()
    bind = subject.store.bind_instance
    assert bind(instance, owner.credential_id, secret) is True
    assert bind(instance, owner.credential_id, secret) is True  # its reconnect
    before = subject.dump()
    # Another credential, even with the secret; the owner's credential without it.
    assert bind(instance, other.credential_id, secret) is False
    assert bind(instance, other.credential_id, _instance_secret()) is False
    assert bind(instance, owner.credential_id, _instance_secret()) is False
    assert subject.dump() == before  # a refused hello changes nothing
    assert bind(instance, owner.credential_id, secret) is True
    assert bind("cd" * 16, other.credential_id, secret) is True  # another id is free
    with pytest.raises(ValueError):
        bind("not-an-id", owner.credential_id, secret)


def test_an_instance_binding_is_the_stores_not_a_process(store: Store) -> None:
    """Another process on the same store (a restarted or a second gateway) sees it; the
    in-memory store is one process's by design, so this holds for the SQL stores."""
    if not isinstance(store, SqlStore):
        return
    owner, _ = store.credentials.create_credential("q1-runner", BOTH, ["q1"], "op")
    other, _ = store.credentials.create_credential("q2-runner", BOTH, ["q2"], "op")
    secret = _instance_secret()
    assert store.credentials.bind_instance("ef" * 16, owner.credential_id, secret)
    second = open_store(store.url)
    try:
        assert second.credentials.bind_instance("ef" * 16, other.credential_id,
                                                secret) is False
        assert second.credentials.bind_instance("ef" * 16, owner.credential_id,
                                                secret) is True
    finally:
        second.close()
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM pulse_gateway_instances")).all()
    assert len(rows) == 1 and secret not in json.dumps([list(map(str, r)) for r in rows])


def test_of_simultaneous_first_hellos_one_owns_the_instance(subject: Subject) -> None:
    made = [subject.store.create_credential(f"runner-{i}", BOTH, ["q"], "op")[0]
            for i in range(6)]
    secret = _instance_secret()
    answers: list[bool] = []
    barrier = threading.Barrier(len(made))

    def hello(credential: Credential) -> None:
        barrier.wait()
        answers.append(subject.store.bind_instance("12" * 16, credential.credential_id,
                                                   secret))

    threads = [threading.Thread(target=hello, args=(c,)) for c in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(answers) == [False] * 5 + [True]


# -- expiry and rotation (issue 37) -------------------------------------------------------
def _poll_refused(store: CredentialStore, token: str, within: float = 10.0) -> None:
    """Until ``token`` is refused (the store's clock passing a time set in the store)."""
    deadline = time.monotonic() + within
    while True:
        try:
            store.authenticate(token)
        except Unauthenticated:
            return
        assert time.monotonic() < deadline, "still authenticates"
        time.sleep(0.05)


def test_a_credential_expires_by_the_store_clock(subject: Subject) -> None:
    record, token = subject.store.create_credential("short", BOTH, ["q"], "test",
                                                    expires_in=0.5)
    start = subject.now()
    assert record.expires_at == pytest.approx(start + 0.5, abs=2.0)
    assert record.active and not record.expired
    assert subject.store.authenticate(token).credential_id == record.credential_id
    _poll_refused(subject.store, token)
    assert subject.now() >= record.expires_at  # refused no earlier than its expiry
    [listed] = subject.store.list_credentials()
    assert listed.expired and not listed.active and listed.revoked_at is None
    got = subject.store.get_credentials([record.credential_id])[record.credential_id]
    assert got.expired  # what a gateway's check of its sessions reads
    with pytest.raises(Unauthenticated):
        got.require(CONSUME, "q")
    with pytest.raises(InvalidConfig, match="expired"):
        subject.store.rotate_credential("short", "test", grace=60)


@pytest.mark.parametrize("expires_in", [0, -1, float("nan")])
def test_an_expiry_must_be_in_the_future(subject: Subject, expires_in: float) -> None:
    with pytest.raises(InvalidConfig, match="expiry"):
        subject.store.create_credential("never", BOTH, ["q"], "test", expires_in=expires_in)
    assert subject.store.list_credentials() == []


def test_a_rotation_keeps_two_live_secrets_for_its_grace(subject: Subject) -> None:
    record, old = subject.store.create_credential("runner", BOTH, ["q"], "test")
    rotated, new = subject.store.rotate_credential("runner", "ops@host", grace=0.8)
    assert new != old and new.startswith(PREFIX + record.credential_id + "_")
    assert (rotated.credential_id, rotated.scopes, rotated.queues) == (
        record.credential_id, record.scopes, record.queues)
    assert rotated.rotated_by == "ops@host" and rotated.previous_until is not None
    for token in (old, new):  # both, during the grace
        assert subject.store.authenticate(token).credential_id == record.credential_id
    _poll_refused(subject.store, old)  # the grace ends by the store clock
    assert subject.store.authenticate(new).credential_id == record.credential_id
    # Only digests are kept, of both secrets.
    for token in (old, new):
        secret = parse_token(token)[1]
        assert secret not in subject.dump()


def test_a_rotation_without_grace_refuses_the_old_secret_at_once(subject: Subject) -> None:
    _, old = subject.store.create_credential("runner", BOTH, ["q"], "test")
    _, new = subject.store.rotate_credential("runner", "test", grace=0)
    _unauthenticated(subject.store, old)
    subject.store.authenticate(new)


def test_a_second_rotation_ends_the_first_secret(subject: Subject) -> None:
    _, first = subject.store.create_credential("runner", BOTH, ["q"], "test")
    _, second = subject.store.rotate_credential("runner", "test", grace=3600)
    _, third = subject.store.rotate_credential("runner", "test", grace=3600)
    _unauthenticated(subject.store, first)  # only the latest two live
    subject.store.authenticate(second)
    subject.store.authenticate(third)


def test_a_revoked_or_unknown_credential_is_not_rotated(subject: Subject) -> None:
    _, token = subject.store.create_credential("runner", BOTH, ["q"], "test")
    subject.store.revoke_credential("runner", "test")
    with pytest.raises(InvalidConfig, match="revoked"):
        subject.store.rotate_credential("runner", "test", grace=60)
    with pytest.raises(NotFound):
        subject.store.rotate_credential("nobody", "test", grace=60)
    with pytest.raises(InvalidConfig, match="grace"):
        subject.store.rotate_credential("runner", "test", grace=-1)
    _unauthenticated(subject.store, token)
