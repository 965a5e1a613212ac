"""The project's own tests, run by Django's test runner (``manage.py test``) with
``CELERY_TASK_ALWAYS_EAGER``: the task runs in-process under an in-process lease, and
its fenced write is a savepoint inside the TestCase's transaction."""

from django.test import TestCase

from example_django.orders.models import Charge
from example_django.orders.tasks import charge


class ChargeTests(TestCase):
    def test_an_eager_charge_is_written_once_under_the_in_process_lease(self) -> None:
        self.assertEqual(charge.delay("order-t").get(), 0)  # the in-process lease's epoch
        self.assertEqual(list(Charge.objects.values_list("order", "epoch")),
                         [("order-t", 0)])
