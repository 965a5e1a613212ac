"""The worker service and its parts: the Celery edge that the steps build and stop.

:mod:`.service` (the worker's services, one object), :mod:`.ports` (what intake, pool
and exits need of it), :mod:`.intake` (reservation at receipt), :mod:`.exits` (one
function per way Celery ends a request), :mod:`.permits`/:mod:`.permit_waits`/
:mod:`.permit_signals` (concurrency limits), and the pieces they share (loop, gate,
starts ahead, chords, beat's schedules, republishing, metrics).
"""
