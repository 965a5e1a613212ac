"""Generate docs/configuration.md from the Settings object.

    python docs/gen_config.py           # rewrite docs/configuration.md
    python docs/gen_config.py --check   # exit 1 if the committed file is out of date

Every ``pulse_*`` setting comes from ``dataclasses.fields(Settings)`` (its metadata
holds the description and the default). The validation rules live in ``RULES``
below, each with a value that must be refused: the test suite feeds that value to
``Settings.from_conf`` and checks that ``InvalidConfig`` names the setting, so the
reference cannot promise a check the code does not make. A setting without a rule
makes this script fail.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_pulse.settings import ON_LOST_POLICIES, Settings  # noqa: E402 - after the path tweak
from celery_pulse.settings import TASK_OPTIONS as KNOWN_TASK_OPTIONS  # noqa: E402
from celery_pulse.store_urls import STORE_SCHEMES  # noqa: E402

OUTPUT = ROOT / "docs" / "configuration.md"


@dataclasses.dataclass(frozen=True)
class Rule:
    """What is checked at startup, and a configuration that the check refuses."""

    text: str
    bad: dict[str, Any]


_POSITIVE = "a number > 0"
RULES: dict[str, Rule] = {
    "store_url": Rule(f"scheme one of `{'`, `'.join(STORE_SCHEMES)}`",
                      {"pulse_store_url": "mongodb://localhost/db"}),
    "database": Rule("an alias in Django's `DATABASES`, of PostgreSQL, MySQL/MariaDB or "
                     "SQLite (a file)", {"pulse_database": ""}),
    "worker_ttl": Rule(_POSITIVE, {"pulse_worker_ttl": 0}),
    "heartbeat_interval": Rule(f"{_POSITIVE}, shorter than `pulse_worker_ttl`",
                               {"pulse_worker_ttl": 5, "pulse_heartbeat_interval": 5}),
    "lease_ttl": Rule(_POSITIVE, {"pulse_lease_ttl": -1}),
    "renew_interval": Rule(f"{_POSITIVE}, shorter than `pulse_lease_ttl`",
                           {"pulse_lease_ttl": 3, "pulse_renew_interval": 4}),
    "revoke_grace": Rule("a number >= 0", {"pulse_revoke_grace": -1}),
    "recover_interval": Rule(_POSITIVE, {"pulse_recover_interval": 0}),
    "recover_batch": Rule("an integer >= 1", {"pulse_recover_batch": 0}),
    "retention": Rule(_POSITIVE, {"pulse_retention": 0}),
    "purge_interval": Rule(_POSITIVE, {"pulse_purge_interval": 0}),
    "beat": Rule("a boolean (`True`/`False`, or `on`/`off`, `yes`/`no`, `1`/`0`)",
                 {"pulse_beat": "sometimes"}),
    "beat_catchup": Rule("`latest` or `all`", {"pulse_beat_catchup": "every"}),
    "leader_ttl": Rule(_POSITIVE, {"pulse_leader_ttl": 0}),
    "leader_interval": Rule(f"{_POSITIVE}, shorter than `pulse_leader_ttl`",
                            {"pulse_leader_ttl": 6, "pulse_leader_interval": 6}),
    "max_attempts": Rule("an integer >= 1", {"pulse_max_attempts": 0}),
    "on_lost": Rule(f"`{'` or `'.join(ON_LOST_POLICIES)}` (or unset)",
                    {"pulse_on_lost": "retry"}),
    "metrics_port": Rule("a TCP port, 0-65535", {"pulse_metrics_port": 70000}),
    "metrics_address": Rule("an IP address (v4 or v6) or a host name; one the worker cannot "
                            "listen on stops it at startup",
                            {"pulse_metrics_address": "not an address"}),
    "metrics_interval": Rule(_POSITIVE, {"pulse_metrics_interval": 0}),
    "store_connect_timeout": Rule(_POSITIVE, {"pulse_store_connect_timeout": 0}),
    "store_pool_size": Rule("an integer from 1 to 64", {"pulse_store_pool_size": 0}),
    "store_pooler": Rule("`auto`, `none`, `session` or `transaction`; statement pooling "
                         "stops the worker at startup", {"pulse_store_pooler": "statement"}),
    "store_listen_url": Rule("a PostgreSQL URL, or unset",
                             {"pulse_store_listen_url": "mysql://db/pulse"}),
    "concurrency_limits": Rule("a dict of task names or `queue:<routing key>` to integers >= 1",
                               {"pulse_concurrency_limits": {"proj.tasks.charge": 0}}),
    "rate_limits": Rule("a dict of task names or `queue:<routing key>` to Celery rates "
                        "(`\"N/s\"`, `\"N/m\"`, `\"N/h\"`, N >= 1)",
                        {"pulse_rate_limits": {"proj.tasks.send": "100/d"}}),
    "permit_backlog": Rule("an integer >= 1", {"pulse_permit_backlog": 0}),
    "permit_wait_event": Rule(_POSITIVE, {"pulse_permit_wait_event": 0}),
    "gateway_url": Rule("a `wss://` (or `ws://`) URL, or unset",
                        {"pulse_gateway_url": "https://gw.example:8443/v1/worker/connect"}),
    "gateway_credentials": Rule("with `pulse_gateway_url`: an existing file",
                                {"pulse_gateway_url": "wss://gw.example:8443/v1/worker/connect",
                                 "pulse_gateway_credentials": "/nonexistent/runner.json"}),
    "gateway_ca": Rule("an existing file, or unset", {"pulse_gateway_ca": "/nonexistent/ca.pem"}),
}

#: Per-task options (``@app.task(pulse_...=...)``): not part of Settings; the names must
#: be ``celery_pulse.settings.TASK_OPTIONS`` (the ones a worker accepts).
TASK_OPTIONS = [
    ("pulse_on_lost", "`redispatch` or `review`",
     "What Recover does when a started attempt of this task is lost; overrides the "
     "`pulse_on_lost` setting.",
     "`redispatch` if `acks_late=True` or `pulse_idempotent=True`, else `review`"),
    ("pulse_max_attempts", "an integer >= 1",
     "Reservations this task may consume (every delivery, re-dispatch and retry "
     "counts one) before it is failed.", "the `pulse_max_attempts` setting"),
    ("pulse_concurrency", "an integer >= 1",
     "At most this many of this task run at once across every worker of the store "
     "(a cluster-wide permit, taken when the task starts and given back when it ends); "
     "the `pulse_concurrency_limits` setting overrides it.", "unlimited"),
    ("pulse_concurrency_key", "a callable `(args, kwargs) -> str`",
     "Partitions the limit: each value it returns gets its own `pulse_concurrency` "
     "permits (e.g. at most 2 syncs per customer). Needs a limit.", "none"),
    ("pulse_rate_limit", "Celery's rate: `\"N/s\"`, `\"N/m\"` or `\"N/h\"`",
     "At most N starts of this task in any window of that length across every worker "
     "of the store (a start counts whatever becomes of it); the `pulse_rate_limits` "
     "setting overrides it. Celery's own `rate_limit` stays per worker.", "unlimited"),
    ("pulse_rate_limit_key", "a callable `(args, kwargs) -> str`",
     "Partitions the rate: each value it returns gets its own `pulse_rate_limit` "
     "(e.g. 10/s per API account). Needs a rate.", "none"),
    ("pulse_idempotent", "a boolean",
     "The task is safe to run again: a lost attempt is re-dispatched like an "
     "`acks_late` task.", "`False`"),
]

HEADER = """\
# Configuration reference

<!-- Generated by docs/gen_config.py from celery_pulse.settings.Settings: do not edit.
     Run `python docs/gen_config.py` after changing a setting. -->

Settings are read from the Celery app's configuration (`app.conf`, or any way Celery
loads config), once, when a worker or a `celery pulse` command starts. Every value
is checked then: a bad one stops the worker with exit code 78 and one line naming the
setting (`InvalidConfig`). Nothing falls back silently: a `pulse_*` key pulse does not
know stops it too, naming the closest known one (`unknown setting pulse_lease_tll (did
you mean pulse_lease_ttl?)`), and so does an unknown `pulse_*` option on a task. With
Celery's `namespace="CELERY"` (Django's `config_from_object("django.conf:settings",
namespace="CELERY")`) write them `CELERY_PULSE_LEASE_TTL`.

`celery inspect conf` (which any client on the broker may ask), `celery report` and
Flower show pulse's settings with the password of a URL masked (`postgresql://u:***@db/x`).

Durations are in seconds. A `datetime.timedelta` or a numeric string works too. The
settings whose default is "a third of" something are derived from their TTL when you
leave them unset. Every interval must be shorter than its TTL.

| setting | default | accepted values | what it does |
| --- | --- | --- | --- |
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field[Any]) -> str:
    text = str(field.metadata.get("default", ""))
    return re.sub(r"\b(worker_ttl|lease_ttl|leader_ttl)\b", r"`pulse_\1`", text)


def render() -> str:
    lines = [HEADER]
    missing = []
    for field in dataclasses.fields(Settings):
        rule = RULES.get(field.name)
        if rule is None:
            missing.append(field.name)
            continue
        doc = field.metadata.get("doc")
        if not doc:
            raise SystemExit(f"Settings.{field.name} has no metadata['doc']")
        lines.append(f"| `pulse_{field.name}` | {_cell(_default(field))} | {_cell(rule.text)} | "
                     f"{_cell(str(doc))} |\n")
    if missing:
        raise SystemExit("docs/gen_config.py: no validation rule documented for "
                         + ", ".join(f"pulse_{name}" for name in missing))
    extra = set(RULES) - {f.name for f in dataclasses.fields(Settings)}
    if extra:
        raise SystemExit(f"docs/gen_config.py: rules for unknown settings: {sorted(extra)}")
    documented = {name for name, *_rest in TASK_OPTIONS}
    if documented != KNOWN_TASK_OPTIONS:
        raise SystemExit(f"docs/gen_config.py: task options documented {sorted(documented)} "
                         f"are not celery_pulse.settings.TASK_OPTIONS "
                         f"{sorted(KNOWN_TASK_OPTIONS)}")
    lines.append("\n## Per-task options\n\n")
    lines.append("Set on the task: `@app.task(acks_late=True, pulse_max_attempts=3)`.\n\n")
    lines.append("| option | accepted values | what it does | default |\n")
    lines.append("| --- | --- | --- | --- |\n")
    for name, accepted, text, default in TASK_OPTIONS:
        lines.append(f"| `{name}` | {accepted} | {text} | {default} |\n")
    lines.append(
        "\n## Celery settings pulse reads\n\n"
        "- `worker_prefetch_multiplier` x concurrency: the most reserved-but-not-started "
        "tasks a worker holds (pulse enforces it, since it acknowledges messages at "
        "reservation).\n"
        "- `beat_schedule`: the static schedule the leader-elected beat runs.\n"
        "- `worker_pool = \"pulse\"`: select the pulse pool without `-P pulse`.\n")
    return "".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run python docs/gen_config.py",
                  file=sys.stderr)
            return 1
        print(f"{OUTPUT.relative_to(ROOT)} is up to date")
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
