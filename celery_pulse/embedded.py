"""The embedded default's broker: kombu's ``filesystem://`` transport, made safe.

Not part of the lease mechanism: a fix applied to kombu in the processes of an app
that uses the filesystem broker (``install(app)`` does it).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any


def atomic_filesystem_puts() -> None:
    """Make kombu's ``filesystem://`` transport publish each message atomically.

    kombu 5.x creates the message file under its final name and then writes it, so a
    consumer polling the folder can read an empty file and die with
    ``JSONDecodeError`` (celery/kombu#1551). This writes under a name consumers
    ignore, then renames (atomic within a folder). Idempotent; process-wide.
    """
    from kombu.exceptions import ChannelError
    from kombu.transport import filesystem
    from kombu.utils.json import dumps

    channel: Any = filesystem.Channel
    if getattr(channel._put, "atomic", False):
        return

    def _put(self: Any, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f"partial-{uuid.uuid4().hex}.writing")
        try:
            with open(partial, "wb") as fh:
                fh.write(str(dumps(payload)).encode())  # type: ignore[no-untyped-call]
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    _put.atomic = True  # type: ignore[attr-defined]
    channel._put = _put
