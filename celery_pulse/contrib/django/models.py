"""Read-only views of pulse's tables for Django's admin: unmanaged models (Django never
creates, alters or drops them; ``manage.py migrate`` runs pulse's own migrations:
:mod:`.schema`), mapping only the columns the admin shows. Writes go through the store
and the operator API (:mod:`celery_pulse.operator`), never through these models.

Times are the store clock's seconds since the epoch (``FloatField``).
"""

from __future__ import annotations

from django.db import models


class Claim(models.Model):
    """One task's claim (``pulse_claims``)."""

    task_id = models.CharField(max_length=255, primary_key=True)
    task_name = models.CharField(max_length=255)
    state = models.CharField(max_length=16)
    queue = models.CharField(max_length=255, null=True)
    holder = models.CharField(max_length=255, null=True)
    epoch = models.BigIntegerField()
    lease_until = models.FloatField(null=True)
    attempts = models.IntegerField()
    max_attempts = models.IntegerField()
    policy = models.CharField(max_length=16)
    retries = models.IntegerField()
    created_at = models.FloatField()
    started_at = models.FloatField(null=True)
    finished_at = models.FloatField(null=True)
    outcome = models.CharField(max_length=32, null=True)
    error = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = "pulse_claims"
        ordering = ("-created_at",)
        verbose_name = "claim"

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}] {self.state} epoch {self.epoch}"


class ReviewItem(Claim):
    """A claim waiting for a human (``needs_review``): the review queue."""

    class Meta:
        proxy = True
        verbose_name = "task in review"
        verbose_name_plural = "review queue"


class Worker(models.Model):
    """One worker of the registry (``pulse_workers``)."""

    worker_id = models.CharField(max_length=255, primary_key=True)
    labels = models.TextField()
    registered_at = models.FloatField()
    last_heartbeat = models.FloatField()
    expires_at = models.FloatField()
    draining = models.BooleanField()

    class Meta:
        managed = False
        db_table = "pulse_workers"
        ordering = ("worker_id",)

    def __str__(self) -> str:
        return self.worker_id


class Leader(models.Model):
    """A leadership and its holder (``pulse_leaders``: the beat's)."""

    key = models.CharField(max_length=255, primary_key=True)
    holder = models.CharField(max_length=255)
    epoch = models.BigIntegerField()
    lease_until = models.FloatField()
    acquired_at = models.FloatField()

    class Meta:
        managed = False
        db_table = "pulse_leaders"

    def __str__(self) -> str:
        return f"{self.key}: {self.holder}"


class ScheduleEntry(models.Model):
    """One entry of the beat's schedule as the leader published it (``pulse_schedule``)."""

    name = models.CharField(max_length=255, primary_key=True)
    task = models.CharField(max_length=255)
    kind = models.CharField(max_length=16)
    spec = models.TextField()
    enabled = models.BooleanField()
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = "pulse_schedule"
        ordering = ("name",)
        verbose_name_plural = "schedule entries"

    def __str__(self) -> str:
        return self.name


class Permit(models.Model):
    """A cluster-wide concurrency limit (``pulse_permits``)."""

    key = models.CharField(max_length=255, primary_key=True)
    max_running = models.IntegerField()
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = "pulse_permits"
        ordering = ("key",)

    def __str__(self) -> str:
        return f"{self.key} <= {self.max_running}"
