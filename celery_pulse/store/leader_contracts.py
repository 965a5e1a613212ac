"""The leader election and beat contracts (the rules common to every store are in
:mod:`celery_pulse.store.contracts`, which gathers them into :class:`~.contracts.Store`)."""

from __future__ import annotations

import abc

from celery_pulse.store.records import LeaderGrant, LeaderInfo, ScheduleRow, Slot


class LeaderStore(abc.ABC):
    """Leader election (seed 001 ``LeaseStore``)."""

    @abc.abstractmethod
    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        """One atomic conditional upsert judged by the store clock.

        Succeeds when the key is free, its lease expired, or ``token`` is the current
        token (a renewal: same token and epoch, lease extended). A new term gets a new
        token and ``epoch + 1``. Returns None when someone else holds a live lease.
        """

    @abc.abstractmethod
    def release_leader(self, key: str, token: str) -> bool:
        """End the lease now, only if ``token`` is current."""

    @abc.abstractmethod
    def get_leader(self, key: str) -> LeaderInfo | None: ...


class BeatStore(abc.ABC):
    """Exactly-once periodic slots and the dynamic schedule."""

    @abc.abstractmethod
    def last_run(self) -> dict[str, float]:
        """``last_run_at`` (the due time of the latest slot) per entry."""

    @abc.abstractmethod
    def init_last_run(self, entry: str, at: float) -> float:
        """Set ``last_run_at`` if the entry has none; returns the stored value."""

    @abc.abstractmethod
    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        """Insert the slot and advance ``last_run_at``, only while ``(token, epoch)``
        is the live leader term by the store clock. False if the slot existed already
        or the term is over."""

    @abc.abstractmethod
    def mark_slot_published(self, entry: str, due_at: float) -> None: ...

    @abc.abstractmethod
    def unpublished_slots(self, limit: int = 100) -> list[Slot]: ...

    @abc.abstractmethod
    def list_schedule(self) -> list[ScheduleRow]: ...

    @abc.abstractmethod
    def put_schedule(self, row: ScheduleRow) -> None: ...

    @abc.abstractmethod
    def remove_schedule(self, name: str) -> bool: ...

    @abc.abstractmethod
    def set_schedule_enabled(self, name: str, enabled: bool) -> bool: ...
