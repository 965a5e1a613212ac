"""The example project, its demo, and the docs that describe them.

* The demo (the README's "run it" command) runs to the end on the embedded default,
  in under a minute, and its narration tells the whole story.
* The example app runs on PostgreSQL + RabbitMQ with the two environment variables.
* The docs: the configuration reference is generated from the code and up to date,
  every documented validation rule is enforced, every Python sample runs, and the
  site builds with ``mkdocs build --strict``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig
from celery_pulse.settings import Settings
from tests.helpers.workers import wait_for

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DEMO_LIMIT = 60.0


def run_bounded(argv: list[str], cwd: Path, env: dict[str, str], timeout: float
                ) -> tuple[int, str, float]:
    """Run ``argv`` in its own process group; kill the group on timeout or exit."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} still running after {timeout:g}s:\n{out[-5000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, time.monotonic() - started


def base_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    for name in ("PULSE_STORE_URL", "PULSE_BROKER_URL", "PULSE_DEMO_FAST", "PULSE_EXAMPLE_DIR",
                 "PULSE_DEMO_KEEP", "PULSE_EXAMPLE_QUEUE"):
        env.pop(name, None)
    return env


# -- the demo ------------------------------------------------------------------------------
#: What the narration must say. Each group starts at a marker line; its events must all
#: come after that marker (in any order: they are observed concurrently).
STORY: list[tuple[str, list[tuple[str, str]]]] = [
    (r"started worker alpha", [
        ("alpha leads the beat", r"alpha is now the beat leader \(epoch 1\)"),
        ("both tasks on alpha", r"store: (payment|report) \S+ is running on alpha")]),
    (r"kill -9 alpha", [
        ("registry expiry", r"registry: alpha's registration EXPIRED by the store clock"),
        ("payment to review", r"Recover took it over and sent it to REVIEW"),
        ("report re-dispatched", r"Recover took it over as epoch 2 and re-published it"),
        ("leader failover", r"(bravo|charlie) is now the beat leader \(epoch [2-9]\)")]),
    (r"kill -STOP (bravo|charlie)", [
        ("takeover from the paused worker", r"Recover took it over as epoch [4-9]"),
        ("LeaseLost in the paused worker", r"(bravo|charlie): LeaseLost raised inside report"),
        ("re-registration", r"re-registered under a new token")]),
    (r"pulse review retry", [
        ("payment charged once",
         r"ledger: order-1001 25\.00 charged by \w+ under fencing token"),
        ("report written", r"report: q3-revenue written by \w+ under epoch [5-9]")]),
    (r"== celery -A example_project pulse status", [
        ("nothing left to review", r"needs review: 0"),
        ("alpha listed dead", r"1 dead")]),
]


#: The top-level modules of every extra (``pip install -e .`` installs none of them).
EXTRAS_MODULES = ("psycopg", "pymysql", "MySQLdb", "mariadb", "redis", "prometheus_client",
                  "websockets", "pytest_celery", "flower", "trustme", "hypothesis")


def without_extras(tmp_path: Path) -> dict[str, str]:
    """:func:`base_env` as on a plain install: importing any extra's module fails, in the
    demo and in every worker it starts (they inherit ``PYTHONPATH``)."""
    stubs = tmp_path / "no-extras"
    for module in EXTRAS_MODULES:
        (stubs / module).mkdir(parents=True)
        (stubs / module / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {module!r}'!r}, name={module!r})\n")
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), env["PYTHONPATH"]])
    return env


def test_the_readme_runs_the_demo_on_a_plain_install() -> None:
    commands = re.findall(r"^python3 -m venv .*$", (ROOT / "README.md").read_text(), re.M)
    demo = [c for c in commands if c.endswith("-m example_project.demo")]
    assert demo == ["python3 -m venv .venv && .venv/bin/pip install -e . && "
                    ".venv/bin/python -m example_project.demo"], commands


def test_demo_tells_the_whole_story_in_under_a_minute(tmp_path: Path) -> None:
    """On a plain install: no extra is importable (the README's command installs none)."""
    code, out, took = run_bounded([sys.executable, "-m", "example_project.demo"], tmp_path,
                                  without_extras(tmp_path), timeout=DEMO_LIMIT + 60)
    assert code == 0, out[-6000:]
    assert took < DEMO_LIMIT, f"the demo took {took:.0f}s:\n{out[-3000:]}"
    position = 0
    for marker, events in STORY:
        start = re.compile(marker).search(out, position)
        assert start is not None, f"no {marker!r} after position {position}:\n{out}"
        position = start.start()
        for what, pattern in events:
            assert re.compile(pattern).search(out, position), \
                f"the narration does not mention {what} ({pattern!r}) after {marker!r}:\n{out}"
    folder = re.search(r"filesystem broker, in (\S+)", out)
    assert folder is not None, out[:500]
    assert not processes_with(f"PULSE_EXAMPLE_DIR={folder.group(1)}"), \
        "some of the demo's processes are still running"


def processes_with(variable: str) -> list[int]:
    """Pids of live processes whose environment contains ``variable`` (NAME=value)."""
    found = []
    needle = variable.encode() + b"/"
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if needle in environ.read_bytes().replace(b"\0", b"\n"):
                found.append(int(environ.parent.name))
    return found


# -- the example app on PostgreSQL + RabbitMQ ----------------------------------------------
@dataclasses.dataclass
class ExampleWorker:
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def example_env(pg_url: str, rabbitmq_url: str, tmp_path: Path) -> dict[str, str]:
    queue = "example-" + uuid.uuid4().hex[:8]
    env = base_env()
    env.update(PULSE_STORE_URL=pg_url, PULSE_BROKER_URL=rabbitmq_url, PULSE_DEMO_FAST="1",
               # A queue of this test's own on the shared RabbitMQ.
               PULSE_EXAMPLE_QUEUE=queue)
    return env


@pytest.fixture
def example_worker(example_env: dict[str, str], tmp_path: Path) -> Iterator[ExampleWorker]:
    log = tmp_path / "worker.log"
    queue = example_env["PULSE_EXAMPLE_QUEUE"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project", "worker", "-P", "pulse",
             "-n", "example@%h", "-c", "2", "-Q", queue, "-l", "info", "--without-mingle",
             "--without-gossip"], cwd=tmp_path, env=example_env, stdout=fh,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield ExampleWorker(proc, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def celery_cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "example_project", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_example_app_on_postgres_and_rabbitmq(
        pg_url: str, rabbitmq_url: str, example_env: dict[str, str], tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    from celery import Celery

    from celery_pulse.store.sql import open_store
    from example_project.schema import ledger, make_engine, rates, reports

    migrated = celery_cli(example_env, tmp_path, "pulse", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "postgresql" in migrated.stdout
    worker: ExampleWorker = request.getfixturevalue("example_worker")
    store = open_store(pg_url)
    engine = make_engine(pg_url)
    producer = Celery("example-producer", broker=rabbitmq_url)
    try:
        wait_for(lambda: any(w.worker_id.startswith("example@") and w.alive
                             for w in store.list_workers()), 60, "the example worker")
        queue = example_env["PULSE_EXAMPLE_QUEUE"]
        charged = producer.send_task("example_project.tasks.charge", ("order-pg", 1234),
                                     {"provider_seconds": 0.2}, queue=queue)
        report = producer.send_task("example_project.tasks.build_report", ("pg-report",),
                                    {"sections": 3, "seconds_per_section": 0.1}, queue=queue)

        def state(task_id: str) -> str | None:
            found = [c.state for c in store.list_claims(None, 1000) if c.task_id == task_id]
            return found[0] if found else None
        wait_for(lambda: state(charged.id) == "succeeded" and state(report.id) == "succeeded",
                 60, "both tasks to succeed")
        with engine.connect() as conn:
            row = conn.execute(sa.select(ledger).where(ledger.c.order_id == "order-pg")).one()
            assert (row.amount_cents, row.task_id, row.epoch) == (1234, charged.id, 1)
            assert row.worker.startswith("example@")
            assert conn.execute(sa.select(reports.c.sections, reports.c.epoch)
                                .where(reports.c.name == "pg-report")).one() == (3, 1)

        # The leader-elected beat inside the worker fires sync_rates (every 2 s here).
        def synced() -> int:
            with engine.connect() as conn:
                return int(conn.execute(sa.select(sa.func.count()).select_from(rates))
                           .scalar_one())
        wait_for(synced, 30, "sync_rates to run from the beat")
        status = celery_cli(example_env, tmp_path, "pulse", "status", "--json")
        payload = json.loads(status.stdout)
        assert payload["leader"]["holder"].startswith("example@"), payload
        assert payload["claims"]["needs_review"] == 0
        # Warm shutdown: deregistered, exit 0.
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(60) == 0, worker.text()[-3000:]
        assert not any(w.worker_id.startswith("example@") for w in store.list_workers())
    finally:
        producer.close()
        store.close()
        engine.dispose()


# -- docs ----------------------------------------------------------------------------------
def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_and_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(DOCS / "gen_config.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr + "\nrun: python docs/gen_config.py"


def test_every_setting_and_task_option_is_in_the_reference() -> None:
    text = (DOCS / "configuration.md").read_text()
    for field in dataclasses.fields(Settings):
        assert f"| `pulse_{field.name}` |" in text, f"pulse_{field.name} is not documented"
    for option in ("pulse_on_lost", "pulse_max_attempts", "pulse_idempotent"):
        assert f"| `{option}` |" in text


def test_every_documented_rule_is_enforced() -> None:
    rules: dict[str, Any] = load_generator().RULES
    assert set(rules) == {f.name for f in dataclasses.fields(Settings)}
    for name, rule in rules.items():
        with pytest.raises(InvalidConfig) as info:
            Settings.from_conf(rule.bad)
        assert info.value.setting == f"pulse_{name}", (name, rule.bad, info.value)


def python_samples() -> list[Any]:
    """Every ```python block of the docs and README that is not a pytest doc-test file,
    with its kind: ``script`` (self-contained) or ``django`` (a module of a Django project,
    marked ``<!-- doc-test: django proj/module.py -->``)."""
    samples = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        for m in re.finditer(r"(<!-- doc-test: (\w+) \S+ -->\n)?```python\n(.*?)```", text, re.S):
            if m.group(2) in ("pytest", "file"):
                continue  # run by tests/integration/test_testing_helpers.py
            where = f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            samples.append(pytest.param(where, m.group(2) or "script", m.group(3), id=where))
    return samples


@pytest.mark.parametrize(("where", "kind", "code"), python_samples())
def test_python_sample_runs(where: str, kind: str, code: str, tmp_path: Path) -> None:
    """Each sample runs as a script (samples are self-contained, and connect to nothing).
    A Django project's module runs in the example project (example_django/, on a SQLite
    file of the test's own), Django set up first and its app's relative imports made
    the example app's."""
    env = base_env()
    if kind == "django":
        code = "import django\ndjango.setup()\n" + code.replace(
            "from .models import", "from example_django.orders.models import")
        env.update(DJANGO_SETTINGS_MODULE="example_django.shop.settings",
                   SHOP_SQLITE=str(tmp_path / "shop.sqlite3"))
    (tmp_path / "sample.py").write_text(code)
    rc, out, _ = run_bounded([sys.executable, "sample.py"], tmp_path, env, timeout=120)
    assert rc == 0, f"{where}:\n{out[-4000:]}"


def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs comes with the dev extra")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
