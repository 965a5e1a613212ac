"""On Redis, pulse shortens visibility_timeout and kombu's sweep of unacknowledged
deliveries, each unless the user set it (no connection made)."""

from __future__ import annotations

from celery import Celery

from celery_pulse.bootsteps.runtime import (
    REDIS_RESTORE,
    REDIS_VISIBILITY_MIN,
    _short_redis_visibility,
)
from celery_pulse.settings import Settings


def _app(broker: str, **conf: object) -> Celery:
    app = Celery("vis", broker=broker, set_as_current=False)
    app.conf.update(pulse_store_url="sqlite:///unused.db", **conf)
    return app


def test_redis_gets_a_visibility_timeout_of_ten_lease_ttls() -> None:
    app = _app("redis://127.0.0.1:6379/0", pulse_lease_ttl=30)
    _short_redis_visibility(app, Settings.from_conf(app.conf))
    assert app.conf.broker_transport_options == {"visibility_timeout": 300,
                                                 "unacked_restore_throttle": 1,
                                                 "unacked_mutex_expire": 60}
    short = _app("redis://127.0.0.1:6379/0", pulse_lease_ttl=1)
    _short_redis_visibility(short, Settings.from_conf(short.conf))
    assert short.conf.broker_transport_options["visibility_timeout"] == REDIS_VISIBILITY_MIN


def test_a_visibility_timeout_set_by_the_user_is_kept() -> None:
    app = _app("redis://127.0.0.1:6379/0",
               broker_transport_options={"visibility_timeout": 7200, "x": 1})
    _short_redis_visibility(app, Settings.from_conf(app.conf))
    assert app.conf.broker_transport_options == {"visibility_timeout": 7200, "x": 1,
                                                 **REDIS_RESTORE}


def test_a_sweep_setting_of_the_user_is_kept() -> None:
    options = {"visibility_timeout": 60, "unacked_restore_throttle": 10,
               "unacked_mutex_expire": 300}
    app = _app("redis://127.0.0.1:6379/0", broker_transport_options=dict(options))
    _short_redis_visibility(app, Settings.from_conf(app.conf))
    assert app.conf.broker_transport_options == options


def test_other_brokers_are_left_alone() -> None:
    app = _app("amqp://guest:guest@127.0.0.1:5672//")
    _short_redis_visibility(app, Settings.from_conf(app.conf))
    assert "visibility_timeout" not in (app.conf.broker_transport_options or {})
