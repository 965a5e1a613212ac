"""One error hierarchy: everything pulse raises is a :class:`PulseError`.

Each class's docstring is its default message, so ``raise Taken()`` still says
something useful. Driver errors are translated in exactly one place
(``celery_pulse.store.sql.errors``) and kept as ``__cause__``.
"""

from __future__ import annotations


class PulseError(Exception):
    """celery-pulse error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidConfig(PulseError):
    """A pulse_* setting is invalid."""

    def __init__(self, message: str | None = None, *, setting: str | None = None) -> None:
        self.setting = setting
        super().__init__(message)


class SchemaMissing(PulseError):
    """The pulse schema is missing or outdated: run `celery -A <app> pulse migrate`."""


class SchemaTooNew(SchemaMissing):
    """The pulse schema is newer than this code and not declared compatible with it:
    upgrade celery-pulse (a SchemaMissing, so every place that refuses to start on an
    unusable schema refuses on this one too)."""


class StoreUnavailable(PulseError):
    """The pulse store cannot be reached."""


class Contended(PulseError):
    """The store kept answering with deadlocks or lock-wait timeouts: try again later.

    Not an outage (the store answers) and not a lost lease (nothing was decided).
    """


class Unstorable(PulseError):
    """The store refused to keep this one delivery (a value it cannot hold).

    Not an outage (the store answered, about this delivery alone): the delivery is
    rejected, never retried, and the others batched with it are reserved on their own.
    """


class NotRegistered(PulseError):
    """This worker is not registered (replaced, expired or deregistered)."""

    #: ``replaced``: a live registration with another token holds the name;
    #: ``expired``: our token is there but its lease ran out by the store clock;
    #: ``missing``: no row (deregistered, or never registered).
    REPLACED = "replaced"
    EXPIRED = "expired"
    MISSING = "missing"

    def __init__(self, message: str | None = None, *, reason: str = MISSING) -> None:
        self.reason = reason
        super().__init__(message)


class LeaseLost(PulseError):
    """The lease on this task was lost: stop applying side effects."""


class Taken(PulseError):
    """Another holder has a live lease on this task."""


class Terminal(PulseError):
    """The task has already finished; it must not run again."""


class NeedsReview(PulseError):
    """A started attempt lost its lease and its task may not run twice: outcome unknown.

    Sent in the ``task-failed`` event Recover sends on the lost attempt's behalf, so
    Flower shows the task failed with the reason; ``celery pulse review`` decides it.
    """


class NotFound(PulseError):
    """No such record in the pulse store."""


class Moved(NotFound):
    """The claim moved on (retried, resolved, or a newer attempt): nothing was changed."""
