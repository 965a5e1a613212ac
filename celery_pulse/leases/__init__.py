"""Per-task leases held by one worker: group commit, batched renewal, self-fencing.

The mechanism only (no Celery, no SQL). The worker adapter feeds it reservations and
completions and hears back through a :class:`LeaseListener`.

Rules:

* Every store call happens on threads owned here: the *committer* (completions,
  reservations and starts, batched: whatever queued up while the previous exchange
  was in flight goes in the next one, all kinds in one round trip where the store
  pipelines them) and the *renewer* (one statement per interval for every lease
  held). None depends on the broker. The one exception: where the store sends
  exchanges without blocking, the committer's work for ops submitted on the worker's
  event loop is done on that loop (:mod:`celery_pulse.leases.loop`), and the thread
  takes only what would block it.
* A lease's local deadline is ``sent_at(last successful grant or renewal) + ttl -
  margin`` on the monotonic clock. Past it the lease is lost even if the store
  cannot be reached: it ends here before the store could grant it to anyone else.
* A lease not returned by a renewal is lost. Lost running tasks get the listener's
  ``on_lost`` (cooperative cancel), then ``on_hard_stop`` after ``grace`` seconds.

The rooms, one job each (none imports the keeper; the keeper composes them):

* :mod:`~celery_pulse.leases.claims`: the records (:class:`LocalClaim`, its states,
  :class:`Counters`, the listener and callback types);
* :mod:`~celery_pulse.leases.table`: the local lease table and its transitions;
* :mod:`~celery_pulse.leases.ops`: the queued :class:`Op` and the batching numbers;
* :mod:`~celery_pulse.leases.exchange`: one exchange with the store and its answers;
* :mod:`~celery_pulse.leases.commit`: the commit thread (``pulse-commit``);
* :mod:`~celery_pulse.leases.loop`: the loop committer, on the worker's event loop;
* :mod:`~celery_pulse.leases.renewal`: the renewer (``pulse-renew``);
* :mod:`~celery_pulse.leases.watchdog`: local deadlines and hard stops (``pulse-watchdog``);
* :mod:`~celery_pulse.leases.keeper`: :class:`LeaseKeeper`, which composes them.
"""

from celery_pulse.leases.claims import (
    LOST,
    LOST_MEMORY,
    RESERVED,
    RUNNING,
    WAITING,
    CompleteCallback,
    Counters,
    LeaseListener,
    LocalClaim,
    ReserveCallback,
    StartCallback,
)
from celery_pulse.leases.keeper import LeaseKeeper
from celery_pulse.leases.ops import (
    BATCH,
    FIRST_BACKOFF,
    LINGER,
    MAX_BACKOFF,
    QUIET,
    Op,
    waited_for,
)

__all__ = [
    "BATCH",
    "FIRST_BACKOFF",
    "LINGER",
    "LOST",
    "LOST_MEMORY",
    "MAX_BACKOFF",
    "QUIET",
    "RESERVED",
    "RUNNING",
    "WAITING",
    "CompleteCallback",
    "Counters",
    "LeaseKeeper",
    "LeaseListener",
    "LocalClaim",
    "Op",
    "ReserveCallback",
    "StartCallback",
    "waited_for",
]
