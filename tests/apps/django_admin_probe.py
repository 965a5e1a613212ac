"""Django's admin pages over pulse (tests/acceptance/test_django.py), run in the example
project's environment with Django's test client: every page drawn from the store's rows,
the review queue's actions applied by the store, and Django's permissions obeyed. Prints
what it saw, one ``name value`` line each. ``--seed``: only make the users and claims (for
a browser on a real server)."""

from __future__ import annotations

import os
import sys

import django

django.setup()

from django.contrib.auth.models import Permission, User  # noqa: E402
from django.test import Client  # noqa: E402

from celery_pulse.contrib.django.admin import pulse_store  # noqa: E402
from celery_pulse.store.base import Completion, Message, ReserveRequest  # noqa: E402

store = pulse_store()
queue = os.environ["SHOP_QUEUE"]


def claim(task_id: str, outcome: str) -> None:
    """A claim that ran and ended ``outcome`` (its message routed to the test's queue)."""
    message = Message(b"[[], {}, {}]", {"id": task_id, "task": "probe.task"}, {},
                      {"routing_key": queue, "exchange": ""}, "application/json", "utf-8")
    [grant] = store.reserve("probe-worker", [ReserveRequest(
        task_id, "probe.task", message, "review", 5)], 30)
    store.start("probe-worker", task_id, grant.epoch, grant.token, 30)
    store.complete("probe-worker", [Completion(task_id, grant.epoch, grant.token, outcome)])


def state(task_id: str) -> str:
    detail = store.claim_detail(task_id)
    return "none" if detail is None else detail.claim.state


for task_id, outcome in (("t-ok", "succeeded"), ("t-review1", "needs_review"),
                         ("t-review2", "needs_review"), ("t-review3", "needs_review")):
    claim(task_id, outcome)

User.objects.create_superuser("boss", "boss@example.com", "pw")
viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
viewer.user_permissions.add(*Permission.objects.filter(
    content_type__app_label="celery_pulse", codename__startswith="view_"))

if "--seed" in sys.argv:
    sys.exit(0)
boss = Client(HTTP_HOST="localhost")
assert boss.login(username="boss", password="pw")
for page in ("claim", "reviewitem", "worker", "leader", "scheduleentry", "permit"):
    response = boss.get(f"/admin/celery_pulse/{page}/")
    print(page, response.status_code)
claims = boss.get("/admin/celery_pulse/claim/").content.decode()
print("claims-listed", *sorted(t for t in ("t-ok", "t-review1") if t in claims))
review = boss.get("/admin/celery_pulse/reviewitem/").content.decode()
print("review-listed", *sorted(t for t in ("t-ok", "t-review1", "t-review2") if t in review))


def act(client: Client, action: str, task_id: str) -> int:
    return client.post("/admin/celery_pulse/reviewitem/",
                       {"action": action, "_selected_action": [task_id]}).status_code


print("retry", act(boss, "retry", "t-review1"), state("t-review1"))
print("resolve", act(boss, "resolve_succeeded", "t-review2"), state("t-review2"))
print("decided-by", *[r.decided_by for r in store.claim_detail("t-review1").reviews])

watcher = Client(HTTP_HOST="localhost")
assert watcher.login(username="viewer", password="pw")
print("viewer-sees", watcher.get("/admin/celery_pulse/reviewitem/").status_code,
      "t-review3" in watcher.get("/admin/celery_pulse/reviewitem/").content.decode())
print("viewer-acted", act(watcher, "retry", "t-review3"), state("t-review3"))
