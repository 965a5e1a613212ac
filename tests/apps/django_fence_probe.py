"""The Django fence's own check in the store (tests/acceptance/test_django.py), run in the
example project's environment: a lease that believes it holds (its local deadline never
passes, as for a worker paused and resumed before its keeper noticed) writes through
``lease.fenced(django.db.connection)`` before and after its claim is taken over. Prints
what happened, one line each, and the epochs of the rows that landed."""

from __future__ import annotations

import math

import django

django.setup()

from django.db import connection  # noqa: E402

from celery_pulse import LeaseLost  # noqa: E402
from celery_pulse.lease import Lease  # noqa: E402
from celery_pulse.settings import Settings  # noqa: E402
from celery_pulse.store.base import Message, ReserveRequest  # noqa: E402
from celery_pulse.store.sql import open_store  # noqa: E402
from celery_pulse.store.sql.fence import make_fencer  # noqa: E402
from example_django.orders.models import Charge  # noqa: E402
from example_django.shop.celery import app  # noqa: E402

TASK = "probe-task"
settings = Settings.from_conf(app.conf)  # the store: Django's DATABASES["default"]
store = open_store(settings.store_url)
message = Message(b"[]", {"id": TASK, "task": "probe"}, {}, {}, "application/json", "utf-8")
[grant] = store.reserve("probe-a", [ReserveRequest(TASK, "probe", message, "redispatch", 5)], 30)
assert store.start("probe-a", TASK, grant.epoch, grant.token, 30) is not None
lease = Lease(TASK, grant.epoch, grant.token, "probe-a", read_deadline=lambda: (math.inf, False),
              fencer=make_fencer(settings.store_url, 30), initial_deadline=math.inf)


def write(epoch: int) -> str:
    try:
        with lease.fenced(connection):
            Charge.objects.create(order="probe", task_id=TASK, epoch=epoch)
    except LeaseLost:
        return "refused"
    return "written"


print("held", write(grant.epoch))
# Another worker's Recover takes the claim over: a new epoch, another holder and token.
with store.engine.begin() as conn:
    conn.exec_driver_sql("UPDATE pulse_claims SET epoch = epoch + 1, holder = 'thief', "
                         "token = 'ffffffffffffffffffffffffffffffff' WHERE task_id = 'probe-task'")
print("stale", write(grant.epoch))
print("rows", *sorted(Charge.objects.filter(order="probe").values_list("epoch", flat=True)))
store.close()
