"""Old path of the loop committer, which now lives in :mod:`celery_pulse.leases.loop`.

Kept so that ``from celery_pulse.loop_commit import ...`` goes on working.
"""

from celery_pulse.leases import (
    BATCH,
    FIRST_BACKOFF,
    LINGER,
    MAX_BACKOFF,
    LeaseKeeper,
    waited_for,
)
from celery_pulse.leases.loop import WRITE_RETRY, LoopCommitter, Reactor
from celery_pulse.leases.ops import Op

__all__ = ["BATCH", "FIRST_BACKOFF", "LINGER", "MAX_BACKOFF", "WRITE_RETRY", "LeaseKeeper",
           "LoopCommitter", "Op", "Reactor", "waited_for"]
