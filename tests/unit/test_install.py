"""install(app) and the pulse pool: refused without install, named in the banner, secrets
masked in Celery's own display of settings."""

from __future__ import annotations

import pytest
from celery import Celery, concurrency
from celery.app import utils
from kombu.utils.imports import symbol_by_name

import celery_pulse
from celery_pulse.install import NOT_INSTALLED, POOL_ALIAS, register_pool_alias
from celery_pulse.pool import prefork
from celery_pulse.pool.pulse_prefork import TaskPool


def test_the_pool_name_shows_pulse_in_the_banner_and_prefork_to_django() -> None:
    register_pool_alias()
    pool = symbol_by_name(concurrency.ALIASES[POOL_ALIAS])
    assert pool is TaskPool and issubclass(pool, prefork.TaskPool)
    # Celery's banner: f"({pool.__module__.split('.')[-1]})"; Django: "prefork" in it.
    assert pool.__module__.split(".")[-1] == "pulse_prefork"
    assert "prefork" in pool.__module__


def test_the_pool_refuses_an_app_without_install(capsys: pytest.CaptureFixture[str]) -> None:
    app = Celery("bare", set_as_current=False)
    with pytest.raises(SystemExit) as info:
        TaskPool(1, app=app)
    assert info.value.code == 78
    err = capsys.readouterr().err
    assert err == f"celery-pulse: cannot start: {NOT_INSTALLED}\n"
    assert "call celery_pulse.install(app) in the module that creates the app" in err


def test_the_pool_builds_for_an_installed_app() -> None:
    app = celery_pulse.install(Celery("installed", set_as_current=False))
    assert TaskPool(1, app=app).pulse is None  # the registry step binds it later


def test_masking_wraps_celerys_filter_once() -> None:
    celery_pulse.install(Celery("a", set_as_current=False))
    wrapped = utils.filter_hidden_settings
    celery_pulse.install(Celery("b", set_as_current=False))
    assert utils.filter_hidden_settings is wrapped
    assert wrapped({"pulse_store_url": "postgresql://u:pw@h/d", "nested": {
        "pulse_gateway_url": "wss://u:pw@gw/v1"}, "database_url": "x"}) == {
        "pulse_store_url": "postgresql://u:***@h/d",
        "nested": {"pulse_gateway_url": "wss://u:***@gw/v1"}, "database_url": "********"}
