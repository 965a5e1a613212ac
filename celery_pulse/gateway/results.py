"""A gateway worker's result backend: outcomes go back in ``task.finish``, nothing else.

In the pool child it is the ``pulse://`` backend's deferral: the attempt's meta is kept
and handed to the worker's parent, which sends it with the finish (the gateway writes it
once the store applied it). Everything else Celery would write or read here needs a store
the worker doesn't have: the parent's own writes (a ``Reject``, a revoke, a lost pool
process) are dropped, their outcome travelling with the completion as its error; reads
(``AsyncResult.get()`` inside a task) fail saying why.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_pulse.backend import PulseBackend
from celery_pulse.errors import PulseError

logger = logging.getLogger(__name__)


class NoResultStore(PulseError):
    """A gateway worker has no result store: results travel in task.finish (read them
    from a client of the gateway's backend)."""


class GatewayBackend(PulseBackend):
    """``result_backend`` of a gateway worker (set by ``install`` with
    ``pulse_gateway_url``)."""

    #: No chord is counted here: a gateway worker can't publish a callback.
    finish_chord = None  # type: ignore[assignment]

    def __init__(self, app: Any = None, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app=app, url="pulse://", **kwargs)

    @property
    def rows(self) -> Any:
        raise NoResultStore()

    def _set_with_state(self, key: str, value: bytes | str, state: str | None) -> None:
        logger.debug("pulse: %s not written here (a gateway worker): the completion "
                     "carries the outcome", key)

    def delete(self, key: str) -> None:
        return None

    def as_uri(self, include_password: bool = False) -> str:
        return "pulse-gateway (results in task.finish)"
