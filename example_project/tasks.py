"""Example tasks."""

from __future__ import annotations

import time

from example_project.app import app


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task(acks_late=True)
def report(seconds: float) -> str:
    """A long task: its lease is renewed for as long as it runs."""
    time.sleep(seconds)
    return f"report done after {seconds}s"
