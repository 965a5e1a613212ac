"""The Pulse page's template loader: pulse's templates first, Flower's otherwise, and one
"Pulse" item added to Flower's own navbar (the file Flower ships, not a copy of it)."""

from __future__ import annotations

import os

import flower
import pytest

from celery_pulse.flower.base import basic_auth_user
from celery_pulse.flower.templates import NAV_END, PulseLoader, with_pulse_item

FLOWER_TEMPLATES = os.path.join(os.path.dirname(flower.__file__), "templates")


def test_the_pulse_item_ends_flowers_primary_navigation() -> None:
    with open(os.path.join(FLOWER_TEMPLATES, "navbar.html"), "rb") as fh:
        shipped = fh.read()
    extended = with_pulse_item(shipped)
    first_list = extended[:extended.index(NAV_END)]
    assert first_list.endswith(with_pulse_item(NAV_END)[:-len(NAV_END)])  # ours, last
    assert b"reverse_url('broker')" in first_list  # Flower's items stay, before ours
    assert extended.count(b">Pulse</a>") == 1
    assert extended.replace(with_pulse_item(NAV_END)[:-len(NAV_END)], b"", 1) == shipped


def test_a_navbar_of_another_shape_is_served_unchanged() -> None:
    assert with_pulse_item(b"<nav>no list</nav>") == b"<nav>no list</nav>"


def test_pulse_templates_come_first_and_flowers_otherwise() -> None:
    loader = PulseLoader(FLOWER_TEMPLATES)
    assert "Leader & beat" in loader.load("pulse_base.html").code  # ours, on Flower's base
    assert "pulse" not in loader.load("base.html").code  # Flower's own base, untouched
    navbar = loader.load("navbar.html").code
    assert "'pulse'" in navbar and "'broker'" in navbar


@pytest.mark.parametrize(("header", "user"), [
    ("Basic b3A6czNjcmV0", "op"), ("Basic !!!", None), ("Bearer abc", None), ("", None)])
def test_the_basic_auth_user_names_who_acted(header: str, user: str | None) -> None:
    assert basic_auth_user(header) == user
