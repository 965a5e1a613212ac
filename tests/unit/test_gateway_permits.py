"""Which concurrency permits a remote start takes (``celery_pulse.gateway.permits``): the
worker asks, within its own task's and queue's keys; the gateway's own limits override
and are required."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_pulse.gateway.permits import StartPermits
from celery_pulse.gateway.protocol import Code, PermitAsk, ProtocolError
from celery_pulse.store.base import Permit


def test_the_workers_own_keys_are_taken_as_asked() -> None:
    asked = (PermitAsk("task:app.send[acme]", 2), PermitAsk("queue:q", 5))
    assert StartPermits().decide("q", "app.send", asked) == (
        Permit("task:app.send[acme]", 2), Permit("queue:q", 5))
    assert StartPermits().decide("q", "app.send", ()) == ()


@pytest.mark.parametrize("key", ["task:app.other", "task:app.sendx", "task:app.sen",
                                 "queue:other", "queue:q2", "anything", "task:app.send]"])
def test_a_key_of_another_task_or_queue_is_forbidden(key: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        StartPermits().decide("q", "app.send", (PermitAsk(key, 1),))
    assert refused.value.code == Code.FORBIDDEN


def test_the_gateways_setting_overrides_the_limit_asked_partition_and_all() -> None:
    gateway = StartPermits({"app.send": 3, "queue:q": 1})
    asked = (PermitAsk("task:app.send[acme]", 50), PermitAsk("queue:q", 100))
    assert gateway.decide("q", "app.send", asked) == (
        Permit("task:app.send[acme]", 3), Permit("queue:q", 1))


@pytest.mark.parametrize("limits, asked, missing", [
    ({"queue:q": 1}, (), "queue:q"),
    ({"app.send": 2}, (PermitAsk("queue:q", 4),), "task:app.send"),
])
def test_a_permit_the_gateway_requires_and_the_worker_left_out_is_forbidden(
        limits: dict[str, int], asked: tuple[PermitAsk, ...], missing: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        StartPermits(limits).decide("q", "app.send", asked)
    assert refused.value.code == Code.FORBIDDEN
    assert missing in refused.value.message and "pulse_concurrency_limits" in refused.value.message


def test_a_task_option_the_gateways_app_registered_is_required_too() -> None:
    app = Celery("gw", set_as_current=False)

    @app.task(name="app.limited", pulse_concurrency=4)
    def limited() -> None: ...

    gateway = StartPermits(app=app)
    assert gateway.required("q", "app.limited") == {"task:app.limited": (4, None)}
    assert gateway.required("q", "app.unknown") == {}
    assert gateway.decide("q", "app.limited", (PermitAsk("task:app.limited", 9),)) == (
        Permit("task:app.limited", 4),)
    with pytest.raises(ProtocolError):
        gateway.decide("q", "app.limited", ())


def test_a_rate_is_a_permit_with_its_window_behind_rate_keys() -> None:
    asked = (PermitAsk("rate:task:app.send[acme]", 10, 1000),
             PermitAsk("rate:queue:q", 300, 60_000))
    assert StartPermits().decide("q", "app.send", asked) == (
        Permit("rate:task:app.send[acme]", 10, 1.0), Permit("rate:queue:q", 300, 60.0))


@pytest.mark.parametrize("ask", [PermitAsk("rate:task:app.other", 1, 1000),
                                 PermitAsk("rate:queue:other", 1, 1000),
                                 PermitAsk("rate:task:app.send", 1),  # a rate needs its window
                                 PermitAsk("task:app.send", 1, 1000)])  # and only a rate has one
def test_a_rate_of_another_task_or_without_its_window_is_forbidden(ask: PermitAsk) -> None:
    with pytest.raises(ProtocolError) as refused:
        StartPermits().decide("q", "app.send", (ask,))
    assert refused.value.code == Code.FORBIDDEN


def test_the_gateways_rate_setting_overrides_and_is_required() -> None:
    gateway = StartPermits(rates={"app.send": (20, 1.0), "queue:q": (100, 60.0)})
    asked = (PermitAsk("rate:task:app.send", 1000, 1000), PermitAsk("rate:queue:q", 5, 1000))
    assert gateway.decide("q", "app.send", asked) == (
        Permit("rate:task:app.send", 20, 1.0), Permit("rate:queue:q", 100, 60.0))
    with pytest.raises(ProtocolError) as refused:
        gateway.decide("q", "app.send", asked[:1])
    assert "rate:queue:q" in refused.value.message
