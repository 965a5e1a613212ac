"""When the startup check warns: a standby attached and commits that do not wait for it.

The readings themselves come from real servers in tests/integration/test_failover_store.py.
"""

from __future__ import annotations

import pytest

from celery_pulse.store.sql.replication import Replication, warning_for


@pytest.mark.parametrize(("commit", "names", "standbys", "warns"), [
    ("on", "", 0, False),  # one server: nothing to lose in a failover
    ("on", "", 1, True),  # a standby, asynchronous
    ("on", "pulse_standby", 1, False),
    ("remote_write", "ANY 1 (s1, s2)", 2, False),
    ("remote_apply", "FIRST 1 (s1)", 1, False),
    ("local", "pulse_standby", 1, True),  # the standby named, the commit not waiting
    ("off", "pulse_standby", 1, True),
])
def test_a_standby_without_synchronous_commits_is_warned_of(commit: str, names: str,
                                                            standbys: int, warns: bool) -> None:
    message = warning_for(Replication(commit, names, standbys))
    assert (message is not None) is warns
    if message:
        assert f"synchronous_commit={commit!r}" in message
        assert f"synchronous_standby_names={names!r}" in message
        assert "docs/production.md" in message
