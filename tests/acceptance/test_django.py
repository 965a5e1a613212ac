"""A Django project on pulse (issue 38; example_django/): the store is Django's own
database (``CELERY_PULSE_DATABASE = "default"``, no store URL written again), and a
task's ORM writes go through ``lease.fenced(django.db.connection)``.

Real processes: Django's ``manage.py migrate``, ``celery pulse migrate`` reading the
store from ``DATABASES``, and ``celery worker -P pulse`` processes of the example
project, on PostgreSQL (Django's ``postgres://`` form, the tables in a schema of their
own through ``search_path``), on MariaDB and on SQLite; RabbitMQ as the broker (Redis for
the pause). A worker is paused (SIGSTOP) inside a task, its claim taken over and run
again by another worker, then resumed: its fenced write must never land.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pulse.contrib.services import Database, Schema
from tests.acceptance.test_beat import (
    View,
    assert_contiguous,
    assert_each_ran_once,
    assert_slots_well_formed,
    wait_more_slots,
    wait_new_term,
)
from tests.helpers import services
from tests.helpers.workers import ROOT, Env, Worker, wait_for

TASK = "example_django.orders.tasks.charge"
TICK = "example_django.orders.tasks.tick"


class Shop:
    """The example project on one database: its environment and commands."""

    def __init__(self, tmp: Path, queue: str, broker: str, store_url: str,
                 database: dict[str, str]) -> None:
        self.tmp, self.queue, self.broker, self.store_url = tmp, queue, broker, store_url
        self.vars = {"SHOP_QUEUE": queue, "SHOP_BROKER_URL": broker, "SHOP_LEASE_TTL": "3",
                     "SHOP_RECOVER_INTERVAL": "0.5", "SHOP_LEADER_TTL": "3",
                     "SHOP_BEAT_CATCHUP": "all", **database}
        self.env = Env(store_url, broker, queue, tmp, app="example_django.shop")

    def run(self, *argv: str, extra: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        variables = {**self.env.vars(), **self.vars, **(extra or {})}
        return subprocess.run([sys.executable, *argv], env=variables, cwd=self.tmp,
                              capture_output=True, text=True, timeout=120)

    def django(self, code: str) -> str:
        """Run ``code`` in ``manage.py shell`` (the ORM, as the admin saves a model): its
        output."""
        ran = self.run(str(ROOT / "example_django" / "manage.py"), "shell", "-v", "0", "-c",
                       code)
        assert ran.returncode == 0, ran.stderr
        return ran.stdout

    def charges(self, order: str) -> list[int]:
        """The epochs of the charges written for ``order``, read by the test itself."""
        engine = sa.create_engine(self.store_url)
        try:
            charge = sa.table("orders_charge", sa.column("order"), sa.column("epoch"))
            with engine.connect() as conn:  # "order" quoted as each database quotes it
                return [int(e) for (e,) in conn.execute(
                    sa.select(charge.c.epoch).where(charge.c.order == order)
                    .order_by(charge.c.epoch))]
        finally:
            engine.dispose()


@pytest.fixture(params=["postgres", "sqlite", "mariadb"])
def shop(request: pytest.FixtureRequest, tmp_path: Path, queue_name: str) -> Iterator[Shop]:
    schema: Schema | Database | None = None
    if request.param == "mariadb":
        services.require("mariadb")
        # Django's MySQL backend is mysqlclient (pulse's store: PyMySQL, its default):
        # installed by CI (.[mysql-c-drivers]), where its absence fails the test.
        if not services.IN_CI:
            pytest.importorskip("MySQLdb", reason="Django's MySQL backend needs mysqlclient "
                                                  "(pip install -e '.[mysql-c-drivers]')")
        schema = Database(services.MARIADB_ADMIN_URL, prefix=services.SCHEMA_PREFIX).create()
        admin = sa.make_url(schema.url)
        database = {"SHOP_DATABASE_URL": f"mysql://{admin.username}@{admin.host}:"
                                         f"{admin.port or 3306}/{admin.database}"}
        store_url = schema.url
    elif request.param == "postgres":
        services.require("postgres")
        schema = Schema(services.PG_ADMIN_URL, prefix=services.SCHEMA_PREFIX).create()
        admin = sa.make_url(services.PG_ADMIN_URL)
        # Django's own spelling of the URL (postgres://), the schema by search_path.
        database = {"SHOP_DATABASE_URL": f"postgres://{admin.username}@{admin.host}:"
                                         f"{admin.port or 5432}/{admin.database}"
                                         f"?search_path={schema.name}"}
        store_url = schema.url
    else:
        path = tmp_path / "shop.sqlite3"
        database = {"SHOP_SQLITE": str(path)}
        store_url = f"sqlite:///{path}"
    # RabbitMQ, unless the test says Redis (:func:`on_redis`): a killed worker's
    # unacknowledged deliveries come back when its connection drops (Redis holds them for
    # its visibility timeout, longer than these tests wait).
    broker = request.getfixturevalue(f"{getattr(request.function, 'broker', 'rabbitmq')}_url")
    made = Shop(tmp_path, queue_name, broker, store_url, database)
    try:
        # Django's migrate makes pulse's schema too (contrib/django/migrations).
        migrated = made.run(str(ROOT / "example_django" / "manage.py"), "migrate", "-v0")
        assert migrated.returncode == 0, migrated.stderr
        yield made
    finally:
        services.tidy_queue(broker, queue_name)
        if schema is not None:
            schema.drop()


@pytest.fixture
def shop_worker(shop: Shop, workers: Callable[..., Worker]) -> Callable[[str], Worker]:
    def start(name: str) -> Worker:
        return workers(shop.env, name, concurrency=1, extra_env=shop.vars).wait_ready(60)
    return start


@pytest.fixture
def client(shop: Shop) -> Iterator[Celery]:
    app = Celery("shop-client", broker=shop.broker, backend="pulse+" + shop.store_url,
                 set_as_current=False)
    yield app
    app.close()


def on_redis(test: Callable[..., None]) -> Callable[..., None]:
    """The test's shop uses Redis: a worker paused with SIGSTOP keeps its RabbitMQ
    connection, and with it the prefetch that would hold the re-dispatched task for
    good; Redis's other consumer takes it."""
    test.broker = "redis"  # type: ignore[attr-defined]
    return test


@on_redis
def test_a_fenced_orm_write_of_a_paused_and_taken_over_task_never_lands(
        shop: Shop, shop_worker: Callable[[str], Worker], client: Celery) -> None:
    folder = shop.tmp / "charge"
    folder.mkdir()
    first = shop_worker("shop-a@test")
    result = client.send_task(TASK, ("order-1", str(folder)), queue=shop.queue)
    wait_for(lambda: (folder / "started-1").exists(), 30, "the first attempt to start")
    first.signal(signal.SIGSTOP)  # paused before its write, past its 3 s lease
    second = shop_worker("shop-b@test")
    [again] = wait_for(lambda: [p for p in folder.glob("started-*") if p.name != "started-1"],
                       30, "Recover to take the paused attempt's task over and run it again")
    epoch = int(again.name.removeprefix("started-"))
    (folder / "go").touch()
    assert result.get(timeout=30) == epoch > 1
    first.signal(signal.SIGCONT)  # its attempt goes on to its fenced write
    first.wait_log(r"LeaseLost|lease lost for task", 30)
    assert shop.charges("order-1") == [epoch]  # the stale attempt's write never landed
    assert second.proc.poll() is None


def test_the_store_refuses_a_stale_attempts_fenced_orm_write_it_does_not_know_is_stale(
        shop: Shop) -> None:
    """The fence's own check, not the worker's: a lease that still believes it holds
    (resumed before its keeper noticed) writes once while it holds, then is taken over;
    its next fenced write is refused by the claim row and rolls back."""
    ran = shop.run(str(ROOT / "tests" / "apps" / "django_fence_probe.py"),
                   extra={"DJANGO_SETTINGS_MODULE": "example_django.shop.settings"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["held written", "stale refused", "rows 1"]


def test_the_admin_shows_pulse_and_its_review_actions_obey_djangos_permissions(
        shop: Shop) -> None:
    """Django's test client on the admin: every page drawn from the store's rows; a
    superuser's retry re-opens a task in review and resolve closes one, recorded under
    their name; a staff user with only view permissions sees the queue and changes
    nothing."""
    ran = shop.run(str(ROOT / "tests" / "apps" / "django_admin_probe.py"),
                   extra={"DJANGO_SETTINGS_MODULE": "example_django.shop.settings"})
    assert ran.returncode == 0, ran.stderr
    seen = dict(line.split(" ", 1) for line in ran.stdout.splitlines())
    assert all(seen[page] == "200" for page in ("claim", "reviewitem", "worker", "leader",
                                                 "scheduleentry", "permit")), seen
    assert seen["claims-listed"] == "t-ok t-review1"
    assert seen["review-listed"] == "t-review1 t-review2"  # needs_review only
    assert seen["retry"] == "302 open"  # re-opened and re-published
    assert seen["resolve"] == "302 succeeded"
    assert seen["decided-by"] == "boss"
    assert seen["viewer-sees"] == "200 True"
    assert seen["viewer-acted"].endswith(" needs_review")  # not allowed: unchanged


def test_django_celery_beat_schedules_fire_each_slot_once_across_leader_kills_and_edits(
        shop: Shop, shop_worker: Callable[[str], Worker]) -> None:
    """django-celery-beat's DatabaseScheduler, read by pulse's leader-elected beat in three
    workers (no celery beat): a 1 s interval task and an every-minute crontab task, saved
    through the ORM as the admin does. The leader is SIGKILLed twice; every period gets
    one slot and each slot (the crontab's too) runs once.
    Then the admin edits the interval to 3 s: the slots after the edit (within one tick)
    are 3 s apart. django-celery-beat's own bookkeeping (last run, run count) follows."""
    ticks = shop.tmp / "ticks.log"
    shop.django(
        "import json\n"
        "from django_celery_beat.models import IntervalSchedule, PeriodicTask\n"
        "from django_celery_beat.models import CrontabSchedule\n"
        "every = IntervalSchedule.objects.create(every=1, period='seconds')\n"
        f"PeriodicTask.objects.create(name='tick', task='{TICK}', interval=every, "
        f"args=json.dumps([{str(ticks)!r}]))\n"
        "minutely = CrontabSchedule.objects.create(minute='*', timezone='UTC')\n"
        f"PeriodicTask.objects.create(name='minutely', task='{TICK}', crontab=minutely, "
        f"args=json.dumps([{str(ticks)!r}]))\n")
    nodes = {name: shop_worker(f"{name}@test") for name in ("d1", "d2", "d3")}
    view = View(shop.store_url)
    try:
        wait_for(view.live_leader, 15, "a leader")
        wait_more_slots(view, 2)
        for _ in range(2):
            wait_more_slots(view, 3)
            old = view.live_leader()
            assert old is not None
            nodes[old.holder.split("@")[0]].kill()
            assert wait_new_term(view, old, 20).holder != old.holder
        wait_more_slots(view, 3)
        shop.django("from django_celery_beat.models import IntervalSchedule\n"
                    "every = IntervalSchedule.objects.get()\n"
                    "every.every = 3\n"
                    "every.save()\n")
        edited = time.time()
        rows = wait_for(lambda: len(r := [s for s in view.slots("tick")
                                          if s.created_at > edited + 1.5]) >= 3 and r,
                        30, "three slots after the edit")
        spacing = [b.due_at - a.due_at for a, b in itertools.pairwise(rows)]
        assert all(abs(gap - 3.0) < 0.01 for gap in spacing), spacing
        slots = view.slots("tick")
        assert_slots_well_formed(slots)
        assert len({s.task_id for s in slots}) == len(slots)
        before = [s for s in slots if s.created_at <= edited]
        assert_contiguous(before, 1.0)
        minutely = wait_for(lambda: view.slots("minutely"), 70, "the crontab's first slot")
        assert all(s.due_at % 60 == 0 for s in minutely)  # on the minute, UTC
        assert len({s.task_id for s in minutely}) == len(minutely)
        assert_each_ran_once(view, ticks, view.slots(), lost_ok=2, timeout=40)
        count = shop.django("from django_celery_beat.models import PeriodicTask\n"
                            "task = PeriodicTask.objects.get(name='tick')\n"
                            "print(task.total_run_count, task.last_run_at is not None)\n")
        runs, last_run = count.split()
        assert int(runs) >= len(slots) - 2 and last_run == "True"
    finally:
        view.store.close()


def test_every_kind_of_django_celery_beat_schedule_becomes_a_beat_entry(shop: Shop) -> None:
    """Interval (its options and headers kept), crontab, clocked (once, at its time);
    disabled and spent one-off rows left out; start_time holding slots back. (Solar
    schedules are Celery's own arithmetic too, and need celery[solar].)"""
    ran = shop.run(str(ROOT / "tests" / "apps" / "django_beat_probe.py"),
                   extra={"DJANGO_SETTINGS_MODULE": "example_django.shop.settings"})
    assert ran.returncode == 0, ran.stderr
    seen = {line.split()[0]: line.split()[1:] for line in ran.stdout.splitlines()}
    assert set(seen) == {"interval", "crontab", "clocked", "later"}
    assert seen["interval"] == ["90.000", "True"]
    assert seen["crontab"] == ["870.000", "False"]  # 10:00:30 -> 10:15:00
    assert seen["clocked"][0] == "100.000"
    assert seen["later"][0] == "3600.000"  # at its start_time, an hour on


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
def test_djangos_test_runner_runs_a_projects_eager_task_tests(shop: Shop) -> None:
    """``manage.py test`` (Django's TestCase: every test in a transaction) with eager
    tasks: the fenced write nests as a savepoint under the in-process lease."""
    ran = shop.run(str(ROOT / "example_django" / "manage.py"), "test", "example_django.orders",
                   "-v", "2", extra={"SHOP_EAGER": "1"})
    assert ran.returncode == 0, ran.stderr
    assert "test_an_eager_charge_is_written_once_under_the_in_process_lease" in ran.stderr
    assert "Ran 1 test" in ran.stderr and "\nOK\n" in ran.stderr


def _schema(url: str) -> dict[str, Any]:
    """pulse's tables as the database describes them: columns (name, type, nullable,
    default), primary key, indexes and unique constraints, table by table."""
    engine = sa.create_engine(url)
    try:
        seen = sa.inspect(engine)
        return {table: {
            "columns": [(c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                        for c in seen.get_columns(table)],
            "primary_key": seen.get_pk_constraint(table)["constrained_columns"],
            "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]))
                              for i in seen.get_indexes(table)),
            "unique": sorted(tuple(u["column_names"]) for u in seen.get_unique_constraints(table))}
            for table in sorted(seen.get_table_names())
            if table.startswith("pulse_") or table == "alembic_version"}
    finally:
        engine.dispose()


def test_manage_py_migrate_makes_the_schema_celery_pulse_migrate_makes(
        shop: Shop, tmp_path: Path) -> None:
    """The fixture's ``manage.py migrate`` made pulse's schema (Alembic's own migrations);
    compared table by table with a fresh store of the same kind that ``celery pulse
    migrate`` made, and a second ``celery pulse migrate`` has nothing to do."""
    again = shop.run("-m", "celery", "-A", "example_django.shop", "pulse", "migrate")
    assert again.returncode == 0, again.stderr
    assert "already at head" in again.stdout
    schema: Schema | Database | None = None
    if shop.store_url.startswith("sqlite"):
        other = Env(f"sqlite:///{tmp_path / 'pulse-cli.sqlite3'}", shop.broker, shop.queue,
                    tmp_path, app="tests.apps.pulseapp")
    else:
        schema = (Database(services.MARIADB_ADMIN_URL, prefix=services.SCHEMA_PREFIX)
                  if shop.store_url.startswith("mysql")
                  else Schema(services.PG_ADMIN_URL, prefix=services.SCHEMA_PREFIX)).create()
        other = Env(schema.url, shop.broker, shop.queue, tmp_path, app="tests.apps.pulseapp")
    try:
        made = other.celery("pulse", "migrate")
        assert made.returncode == 0, made.stderr
        django_made, cli_made = _schema(shop.store_url), _schema(other.store_url)
        assert len(django_made) > 10
        assert django_made == cli_made
    finally:
        if schema is not None:
            schema.drop()


def test_the_store_is_djangos_database_and_a_wrong_alias_is_named(
        shop: Shop, shop_worker: Callable[[str], Worker], client: Celery) -> None:
    """No store URL anywhere: the worker's store is Django's database (its claims and
    results are there), and an alias that DATABASES lacks stops a command naming the
    setting."""
    shop_worker("shop-c@test")
    result = client.send_task(TASK, ("order-2",), queue=shop.queue)
    assert result.get(timeout=30) == 1
    assert shop.charges("order-2") == [1]
    # manage.py pulse: the celery pulse commands on the project's app and store.
    listed = shop.run(str(ROOT / "example_django" / "manage.py"), "pulse", "claims",
                      "--state", "succeeded", "--json")
    assert listed.returncode == 0, listed.stderr
    [claim] = json.loads(listed.stdout)
    assert (claim["task_id"], claim["state"], claim["epoch"]) == (result.id, "succeeded", 1)
    workers = shop.run(str(ROOT / "example_django" / "manage.py"), "pulse", "workers", "--json")
    assert [w["id"] for w in json.loads(workers.stdout)] == ["shop-c@test"]
    wrong = shop.run("-m", "celery", "-A", "example_django.shop", "pulse", "status",
                     extra={"SHOP_PULSE_DATABASE": "replica"})
    assert wrong.returncode != 0
    assert "pulse_database: 'replica' is not in Django's DATABASES" in wrong.stderr


def test_an_eager_task_gets_an_in_process_lease_and_its_fenced_write_commits(
        shop: Shop) -> None:
    """CELERY_TASK_ALWAYS_EAGER (a Django test run): current_lease() is the in-process
    lease and lease.fenced(connection) a plain transaction.atomic()."""
    script = ("import django; django.setup()\n"
              "from example_django.orders.tasks import charge\n"
              "print(charge.delay('order-3').get())\n")
    ran = shop.run("-c", script, extra={"SHOP_EAGER": "1",
                                         "DJANGO_SETTINGS_MODULE": "example_django.shop.settings"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["0"]  # the in-process lease's epoch
    assert shop.charges("order-3") == [0]


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
def test_the_admin_in_a_real_browser_retries_a_task_in_review(shop: Shop) -> None:
    """Headless Chromium on Django's own server (``runserver``): log in, open the review
    queue, select a task, run "retry"; the store has it re-opened. Screenshots of the
    claims and the review queue go to test-artifacts/ (and docs/img with
    ``PULSE_DOCS_SCREENSHOTS=1``)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        if services.IN_CI:
            pytest.fail("chromium is not installed (CI=true: .ci/run installs it)")
        pytest.skip("chromium is not installed")
    from playwright.sync_api import expect, sync_playwright

    variables = {"DJANGO_SETTINGS_MODULE": "example_django.shop.settings"}
    seeded = shop.run(str(ROOT / "tests" / "apps" / "django_admin_probe.py"), "--seed",
                      extra=variables)
    assert seeded.returncode == 0, seeded.stderr
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "example_django" / "manage.py"), "runserver",
         "--noreload", "--insecure", f"127.0.0.1:{port}"],
        env={**shop.env.vars(), **shop.vars, **variables}, cwd=shop.tmp,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    shots = [ROOT / "test-artifacts"] + ([ROOT / "docs" / "img"]
                                         if os.environ.get("PULSE_DOCS_SCREENSHOTS") else [])
    try:
        wait_for(lambda: _answers(port), 30, "Django's server to answer")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=[
                "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update"])
            page = browser.new_page(viewport={"width": 1600, "height": 720})
            page.goto(f"http://localhost:{port}/admin/login/?next=/admin/celery_pulse/claim/")
            page.fill("#id_username", "boss")
            page.fill("#id_password", "pw")
            page.click("input[type=submit]")
            expect(page.locator("#result_list")).to_contain_text("t-review1")
            for folder in shots:
                folder.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(folder / "django-admin-claims.png"), full_page=True)
            page.goto(f"http://localhost:{port}/admin/celery_pulse/reviewitem/")
            page.check("input[name=_selected_action][value=t-review1]")
            page.select_option("select[name=action]", "retry")
            page.click("button[name=index]")
            expect(page.locator("ul.messagelist")).to_contain_text("1 task(s) retried.")
            for folder in shots:
                page.screenshot(path=str(folder / "django-admin-review.png"), full_page=True)
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
    store = sa.create_engine(shop.store_url)
    try:
        with store.connect() as conn:
            state = conn.execute(sa.text("SELECT state FROM pulse_claims WHERE task_id = "
                                         "'t-review1'")).scalar_one()
    finally:
        store.dispose()
    assert state == "open"  # re-opened, its message published again


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
