from django.db import models


class Charge(models.Model):
    """One charge of an order, written by the attempt (task id, epoch) that made it."""

    order = models.CharField(max_length=64)
    task_id = models.CharField(max_length=255)
    epoch = models.IntegerField()
    created = models.DateTimeField(auto_now_add=True)
