"""What a gateway worker declares as capabilities, and which task names they cover
(``celery_pulse.gateway.routing``)."""

from __future__ import annotations

from celery_pulse.gateway.routing import Capabilities, declared


def test_a_worker_declares_its_task_names_while_they_fit() -> None:
    assert declared(["b.y", "a.x", "celery.chord_unlock"], 32, 128) == ["a.x", "b.y"]


def test_past_the_limit_it_declares_modules_then_everything() -> None:
    names = [f"proj.m{i % 3}.t{i}" for i in range(40)]
    assert declared(names, 32, 128) == ["proj.m0.*", "proj.m1.*", "proj.m2.*"]
    assert declared([f"m{i}.t" for i in range(40)], 32, 128) == ["*"]
    assert declared(["a." + "x" * 200], 32, 128) == ["a.*"]  # a name too long for a label
    assert declared(["x" * 200], 32, 128) == ["*"]


def test_a_worker_without_tasks_of_its_own_declares_only_celery() -> None:
    assert declared(["celery.backend_cleanup"], 32, 128) == ["celery"]
    assert not Capabilities(["celery"]).cover("proj.add")


def test_what_capabilities_cover() -> None:
    caps = Capabilities(["proj.add", "billing.*"])
    assert caps.cover("proj.add") and not caps.cover("proj.addx")
    assert caps.cover("billing.charge") and caps.cover("billing.sub.refund")
    assert not caps.cover("billingx.charge") and not caps.cover("billing")
    assert caps.cover("celery.chord_unlock")  # every Celery worker has its built-ins
    assert Capabilities(["*"]).cover("anything.at.all")
