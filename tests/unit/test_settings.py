"""Settings: derived defaults, validation that names the setting, from_conf, mask_url."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from celery_pulse.errors import InvalidConfig, PulseError
from celery_pulse.settings import TASK_OPTIONS, Settings, known_settings, refuse_unknown_task_options
from celery_pulse.store_urls import default_store_url, mask_url, masked_value

SQLITE = "sqlite:///pulse.sqlite3"


def invalid(setting: str, **kwargs: Any) -> InvalidConfig:
    """Build Settings(**kwargs), expect InvalidConfig naming ``setting``; return it."""
    with pytest.raises(InvalidConfig) as info:
        Settings(**kwargs)
    exc = info.value
    assert exc.setting == setting
    assert setting in str(exc)
    return exc


def invalid_conf(setting: str, conf: dict[str, Any]) -> InvalidConfig:
    with pytest.raises(InvalidConfig) as info:
        Settings.from_conf(conf)
    exc = info.value
    assert exc.setting == setting
    assert setting in str(exc)
    return exc


# -- defaults -----------------------------------------------------------------
def test_defaults() -> None:
    s = Settings()
    assert s.store_url == default_store_url()
    assert s.store_url.startswith("sqlite:///")
    assert s.worker_ttl == 30.0
    assert s.lease_ttl == 30.0
    assert s.leader_ttl == 15.0
    assert s.on_lost is None
    assert s.beat is True


def test_intervals_default_to_a_third_of_their_ttl() -> None:
    s = Settings(store_url=SQLITE, worker_ttl=9.0, lease_ttl=12.0, leader_ttl=6.0)
    assert s.heartbeat_interval == pytest.approx(3.0)
    assert s.renew_interval == pytest.approx(4.0)
    assert s.leader_interval == pytest.approx(2.0)


def test_explicit_intervals_are_kept() -> None:
    s = Settings(store_url=SQLITE, worker_ttl=9.0, heartbeat_interval=8.0,
                 lease_ttl=12.0, renew_interval=1.0, leader_ttl=6.0, leader_interval=5.5)
    assert (s.heartbeat_interval, s.renew_interval, s.leader_interval) == (8.0, 1.0, 5.5)


def test_settings_are_frozen() -> None:
    s = Settings(store_url=SQLITE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.worker_ttl = 1.0  # type: ignore[misc]


def test_invalid_config_is_a_pulse_error() -> None:
    assert issubclass(InvalidConfig, PulseError)


# -- interval must be shorter than its TTL ---------------------------------------
@pytest.mark.parametrize(("interval", "ttl"), [
    ("heartbeat_interval", "worker_ttl"),
    ("renew_interval", "lease_ttl"),
    ("leader_interval", "leader_ttl"),
])
@pytest.mark.parametrize("factor", [1.0, 2.0], ids=["equal", "longer"])
def test_interval_not_shorter_than_ttl(interval: str, ttl: str, factor: float) -> None:
    exc = invalid(f"pulse_{interval}", store_url=SQLITE, **{ttl: 6.0, interval: 6.0 * factor})
    assert f"pulse_{ttl}" in str(exc)


# -- positive durations -----------------------------------------------------------
@pytest.mark.parametrize("ttl", ["worker_ttl", "lease_ttl", "leader_ttl"])
@pytest.mark.parametrize("value", [0.0, -5.0])
def test_non_positive_ttl(ttl: str, value: float) -> None:
    invalid(f"pulse_{ttl}", store_url=SQLITE, **{ttl: value})


@pytest.mark.parametrize("name", ["heartbeat_interval", "recover_interval", "retention",
                                  "store_connect_timeout", "metrics_interval"])
def test_non_positive_duration(name: str) -> None:
    invalid(f"pulse_{name}", store_url=SQLITE, **{name: -1.0})


def test_negative_revoke_grace() -> None:
    invalid("pulse_revoke_grace", store_url=SQLITE, revoke_grace=-0.5)
    assert Settings(store_url=SQLITE, revoke_grace=0.0).revoke_grace == 0.0


@pytest.mark.parametrize("name", ["recover_batch", "max_attempts"])
def test_counts_at_least_one(name: str) -> None:
    invalid(f"pulse_{name}", store_url=SQLITE, **{name: 0})


# -- store URL -------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "sqlite:////tmp/x.sqlite3",
    "sqlite+pysqlite:///x.sqlite3",
    "postgresql://u@h/db",
    "postgresql+psycopg://u:pw@h:5432/db",
    "mysql://u@h/db",
    "mysql+pymysql://u:pw@h:3306/db",
    "mariadb+pymysql://u:pw@h/db",
    "mysql+mysqldb://u:pw@h/db",
    "mariadb+mariadbconnector://u:pw@h/db",
])
def test_known_store_schemes(url: str) -> None:
    # A driverless PostgreSQL URL is read as psycopg 3 (tests/unit/test_store_urls.py).
    expected = url.replace("postgresql://", "postgresql+psycopg://")
    assert Settings(store_url=url).store_url == expected


@pytest.mark.parametrize("url", [
    "mysql+asyncmy://pulse:s3cr3t-pw@db.example:3306/pulse",
    "postgresql+asyncpg://pulse:s3cr3t-pw@db.example/pulse",
    "redis://:s3cr3t-pw@localhost:6379/0",
])
def test_unknown_store_scheme_masks_password(url: str) -> None:
    exc = invalid("pulse_store_url", store_url=url)
    assert "s3cr3t-pw" not in str(exc)
    assert "***" in str(exc)
    assert "db.example" in str(exc) or "localhost" in str(exc)


def test_store_url_without_scheme() -> None:
    invalid("pulse_store_url", store_url="/var/lib/pulse.sqlite3")


# -- on_lost ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["redispatch", "review"])
def test_on_lost_policies(policy: str) -> None:
    assert Settings(store_url=SQLITE, on_lost=policy).on_lost == policy


def test_bad_on_lost() -> None:
    exc = invalid("pulse_on_lost", store_url=SQLITE, on_lost="retry")
    assert "retry" in str(exc)


# -- from_conf -------------------------------------------------------------------
def test_from_conf_reads_pulse_keys_from_a_plain_dict() -> None:
    conf = {
        "pulse_store_url": SQLITE,
        "pulse_worker_ttl": 12,
        "pulse_lease_ttl": "45.5",
        "pulse_recover_batch": "7",
        "pulse_max_attempts": 3.0,
        "pulse_beat": "off",
        "pulse_on_lost": "review",
        "worker_ttl": 999,  # not a pulse_* key
        "broker_url": "amqp://guest:guest@localhost//",
    }
    s = Settings.from_conf(conf)
    assert s.store_url == SQLITE
    assert s.worker_ttl == 12.0 and isinstance(s.worker_ttl, float)
    assert s.heartbeat_interval == pytest.approx(4.0)
    assert s.lease_ttl == 45.5
    assert s.recover_batch == 7 and isinstance(s.recover_batch, int)
    assert s.max_attempts == 3 and isinstance(s.max_attempts, int)
    assert s.beat is False
    assert s.on_lost == "review"


def test_from_conf_empty_is_defaults() -> None:
    assert Settings.from_conf({}) == Settings()


def test_from_conf_none_means_default() -> None:
    s = Settings.from_conf({"pulse_store_url": SQLITE, "pulse_worker_ttl": None})
    assert s.worker_ttl == 30.0


def test_from_conf_accepts_timedelta_for_durations() -> None:
    s = Settings.from_conf({
        "pulse_store_url": SQLITE,
        "pulse_worker_ttl": timedelta(minutes=1),
        "pulse_heartbeat_interval": timedelta(seconds=15),
        "pulse_lease_ttl": timedelta(milliseconds=1500),
        "pulse_retention": timedelta(days=2),
    })
    assert s.worker_ttl == 60.0
    assert s.heartbeat_interval == 15.0
    assert s.lease_ttl == 1.5
    assert s.renew_interval == pytest.approx(0.5)
    assert s.retention == 172800.0


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("yes", True), (" ON ", True), ("true", True), (True, True),
    ("0", False), ("no", False), ("Off", False), ("false", False), (False, False),
])
def test_from_conf_bool(value: Any, expected: bool) -> None:
    assert Settings.from_conf({"pulse_store_url": SQLITE, "pulse_beat": value}).beat is expected


@pytest.mark.parametrize(("key", "value"), [
    ("pulse_worker_ttl", "abc"),
    ("pulse_worker_ttl", True),
    ("pulse_lease_ttl", [1, 2]),
    ("pulse_recover_batch", "abc"),
    ("pulse_recover_batch", 1.5),
    ("pulse_max_attempts", "2.5"),
    ("pulse_max_attempts", False),
    ("pulse_beat", "maybe"),
    ("pulse_store_url", 42),
    ("pulse_on_lost", 1),
])
def test_from_conf_bad_types(key: str, value: Any) -> None:
    exc = invalid_conf(key, {"pulse_store_url": SQLITE, key: value})
    assert repr(value) in str(exc)


def test_from_conf_validates() -> None:
    exc = invalid_conf("pulse_heartbeat_interval",
                       {"pulse_store_url": SQLITE, "pulse_worker_ttl": timedelta(seconds=10),
                        "pulse_heartbeat_interval": timedelta(seconds=10)})
    assert "pulse_worker_ttl" in str(exc)


def test_from_conf_bad_url_masks_password() -> None:
    exc = invalid_conf("pulse_store_url", {"pulse_store_url": "oracle://u:hunter2@h/db"})
    assert "hunter2" not in str(exc)
    assert "u:***@h" in str(exc)


# -- mask_url --------------------------------------------------------------------
@pytest.mark.parametrize(("url", "masked"), [
    ("postgresql+psycopg://pulse:pw@db:5432/pulse?sslmode=require",
     "postgresql+psycopg://pulse:***@db:5432/pulse?sslmode=require"),
    ("postgresql://pulse:p%40ss@db/pulse", "postgresql://pulse:***@db/pulse"),
    ("postgresql://pulse:p@ss@db/pulse", "postgresql://pulse:***@db/pulse"),
    ("redis://:pw@localhost:6379/0", "redis://:***@localhost:6379/0"),
])
def test_mask_url_hides_password(url: str, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.parametrize("url", [
    "postgresql://pulse@db/pulse",
    "postgresql://db/pulse",
    "sqlite:////var/lib/pulse.sqlite3",
    "sqlite:///:memory:",
])
def test_mask_url_without_password_is_unchanged(url: str) -> None:
    assert mask_url(url) == url


# -- unknown keys are refused, never ignored ---------------------------------------
def test_a_misspelt_setting_names_the_closest_known_one() -> None:
    exc = invalid_conf("pulse_lease_tll", {"pulse_store_url": SQLITE, "pulse_lease_tll": 10})
    assert str(exc) == "unknown setting pulse_lease_tll (did you mean pulse_lease_ttl?)"


def test_every_unknown_key_is_named_at_once() -> None:
    exc = invalid_conf("pulse_worker_tll", {"pulse_worker_tll": 1, "pulse_bogus_thing": 2})
    assert "pulse_worker_tll (did you mean pulse_worker_ttl?)" in str(exc)
    assert "unknown setting pulse_bogus_thing (see docs/configuration.md" in str(exc)


def test_the_known_settings_are_the_fields() -> None:
    assert known_settings() == {f"pulse_{f.name}" for f in dataclasses.fields(Settings)}
    Settings.from_conf({key: None for key in known_settings()})  # each one is accepted


def _celery_app(config: type, namespace: str | None) -> Any:
    from celery import Celery

    app = Celery("settings-test", set_as_current=False)
    app.config_from_object(config, namespace=namespace)
    return app


def test_a_misspelt_setting_under_celerys_namespace_is_named_as_written() -> None:
    class Config:
        CELERY_PULSE_STORE_URL = SQLITE
        CELERY_PULSE_LEASE_TLL = 10

    exc = invalid_conf("CELERY_PULSE_LEASE_TLL", _celery_app(Config, "CELERY").conf)
    assert str(exc) == ("unknown setting CELERY_PULSE_LEASE_TLL "
                        "(did you mean CELERY_PULSE_LEASE_TTL?)")


def test_settings_under_celerys_namespace_are_read() -> None:
    class Config:
        CELERY_PULSE_STORE_URL = SQLITE
        CELERY_PULSE_LEASE_TTL = 12
        pulse_worker_ttl = 9  # Celery reads the plain name under a namespace too
        PULSE_UNRELATED = 1  # another library's setting in a Django settings module

    s = Settings.from_conf(_celery_app(Config, "CELERY").conf)
    assert (s.store_url, s.lease_ttl, s.worker_ttl) == (SQLITE, 12.0, 9.0)


def test_an_upper_case_setting_without_a_namespace_is_refused() -> None:
    # Celery never looks up PULSE_LEASE_TTL for pulse_lease_ttl: it would be ignored.
    class Config:
        PULSE_LEASE_TTL = 10

    exc = invalid_conf("PULSE_LEASE_TTL", _celery_app(Config, None).conf)
    assert "write pulse_lease_ttl" in str(exc)


def test_a_celery_app_with_a_misspelt_setting_is_refused() -> None:
    app = _celery_app(type("Config", (), {}), None)
    app.conf.pulse_renew_intervall = 1
    exc = invalid_conf("pulse_renew_intervall", app.conf)
    assert "did you mean pulse_renew_interval?" in str(exc)


def test_an_unknown_task_option_names_the_task_and_the_closest_option() -> None:
    from celery import Celery

    app = Celery("task-options-test", set_as_current=False)

    @app.task(name="proj.charge", pulse_max_attempts=3, pulse_idempotent=True)
    def charge() -> None: ...

    refuse_unknown_task_options(app.tasks)  # known options pass

    @app.task(name="proj.refund", pulse_max_atempts=3)
    def refund() -> None: ...

    with pytest.raises(InvalidConfig) as info:
        refuse_unknown_task_options(app.tasks)
    assert str(info.value) == ("task proj.refund: unknown option pulse_max_atempts "
                               "(did you mean pulse_max_attempts?)")
    assert info.value.setting == "pulse_max_atempts"


def test_task_options_are_the_ones_the_package_reads() -> None:
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "celery_pulse"
    read = set()
    for path in package.rglob("*.py"):
        read |= set(re.findall(r"getattr\(\s*(?:task|t)\s*,\s*\"(pulse_\w+)\"",
                               path.read_text()))
    assert read == TASK_OPTIONS


# -- secrets ------------------------------------------------------------------------
@pytest.mark.parametrize(("key", "value", "shown"), [
    ("pulse_store_url", "postgresql+psycopg://root:secretpw@db/test",
     "postgresql+psycopg://root:***@db/test"),
    ("CELERY_PULSE_STORE_URL", "postgresql://u:secretpw@db/x", "postgresql://u:***@db/x"),
    ("gateway_url", "wss://u:secretpw@gw:8443/v1", "wss://u:***@gw:8443/v1"),
    ("pulse_store_url", "sqlite:////var/lib/pulse.sqlite3", "sqlite:////var/lib/pulse.sqlite3"),
    ("pulse_beat_catchup", "latest", "latest"),
    ("pulse_lease_ttl", 30, 30),
    ("pulse_store_url", "postgresql://u:secretpw@[::1/x", "********"),
    ("my_own_url", "postgresql://u:pw@db/x", "postgresql://u:pw@db/x"),  # not pulse's
])
def test_masked_value(key: str, value: Any, shown: Any) -> None:
    assert masked_value(key, value) == shown


def test_celerys_conf_table_masks_pulse_passwords_after_install() -> None:
    from celery import Celery

    import celery_pulse

    app = Celery("mask-test", set_as_current=False)
    app.conf.update(pulse_store_url="postgresql+psycopg://root:secretpw@db/test",
                    pulse_beat_catchup="all", broker_url="amqp://guest:brokerpw@h//")
    celery_pulse.install(app)
    table = app.conf.table(with_defaults=True)
    assert table["pulse_store_url"] == "postgresql+psycopg://root:***@db/test"
    assert table["pulse_beat_catchup"] == "all"
    assert "brokerpw" not in str(table)  # Celery's own masking still applies
    assert app.conf.table(censored=False)["pulse_store_url"].endswith("secretpw@db/test")


@pytest.mark.parametrize(("written", "kept"), [
    ("0.0.0.0", "0.0.0.0"), (" 127.0.0.1 ", "127.0.0.1"), ("::1", "::1"), ("[::]", "::"),
    ("::ffff:127.0.0.1", "::ffff:7f00:1"), ("localhost", "localhost"),
    ("metrics.internal.example", "metrics.internal.example")])
def test_metrics_address_takes_ip_addresses_and_host_names(written: str, kept: str) -> None:
    assert Settings(store_url=SQLITE, metrics_address=written).metrics_address == kept


@pytest.mark.parametrize("address", ["", "   ", "10.0.0.300", "bad address", "host:9808",
                                     "http://0.0.0.0", "-lead.example", "[::1"])
def test_a_bad_metrics_address_names_the_setting(address: str) -> None:
    exc = invalid("pulse_metrics_address", store_url=SQLITE, metrics_address=address)
    assert repr(address) in str(exc)


def test_the_metrics_address_is_read_under_celerys_namespace() -> None:
    class Config:
        CELERY_PULSE_STORE_URL = SQLITE
        CELERY_PULSE_METRICS_ADDRESS = "::1"
        CELERY_PULSE_METRICS_PORT = 9808

    settings = Settings.from_conf(_celery_app(Config, "CELERY").conf)
    assert (settings.metrics_address, settings.metrics_port) == ("::1", 9808)


# -- store connections -----------------------------------------------------------------
def test_store_pool_size_defaults_to_four_and_is_read_from_conf() -> None:
    assert Settings(store_url=SQLITE).store_pool_size == 4
    assert Settings.from_conf({"pulse_store_url": SQLITE,
                               "pulse_store_pool_size": "2"}).store_pool_size == 2


@pytest.mark.parametrize("value", [0, -1, 65])
def test_store_pool_size_out_of_range(value: int) -> None:
    exc = invalid("pulse_store_pool_size", store_url=SQLITE, store_pool_size=value)
    assert "between 1 and 64" in str(exc) and repr(value) in str(exc)


@pytest.mark.parametrize("value", [True, 2.5, "many"])
def test_store_pool_size_not_a_count(value: Any) -> None:
    invalid_conf("pulse_store_pool_size", {"pulse_store_url": SQLITE,
                                           "pulse_store_pool_size": value})
