"""The exit codes a ``-P pulse`` worker ends with, apart from Celery's own."""

from __future__ import annotations

#: A setting, the store or the app's install is wrong: EX_CONFIG (one line on stderr).
EXIT_CONFIG = 78
#: Another live worker took this worker's name (the registry): a warm shutdown, then this.
EXIT_IDENTITY_LOST = 3
