"""The benchmark runner's quick mode, end to end, so that it does not rot.

Runs ``python -m benchmarks run --quick --output <tmp>`` in a subprocess (real workers,
brokers, PostgreSQL, RedBeat) and checks only that it finished and wrote its report:
no timing is asserted here (that is what the report itself is for). The timeouts only
guard against a hang: the quick run takes ~4.5 minutes on a 2-core machine (4.4 there at
6517c90), so 300 s, the guard until then, was within a slow machine's reach.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import services
from tests.helpers.pgbouncer import pgbouncer_binary

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.benchmark
@pytest.mark.timeout(540)
def test_benchmark_quick_mode_runs_and_writes_its_report(tmp_path: Path) -> None:
    for name in ("postgres", "mariadb", "rabbitmq", "redis"):
        services.require(name)
    pgbouncer_binary()  # the wake-up section runs one (skipped locally without it)
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--quick", "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    # The console table.
    assert "Verdict" in proc.stdout and "Throughput" in proc.stdout, proc.stdout
    # The markdown page: summary table plus one section per measurement, none failed.
    page = (out / "benchmarks.md").read_text()
    assert "| What | pulse | Baseline | Ratio / detail | Target | Verdict |" in page
    assert "python -m benchmarks run --quick" in page
    for section in ("1. Throughput", "2. SQL cost", "3. Store scale", "4. Recovery",
                    "5. Leader failover", "6. Lease-loss reaction", "7. Memory",
                    "8. MySQL/MariaDB drivers", "9. Concurrency permits"):
        assert f"## {section}" in page, section
    assert "This section failed" not in page
    # Issue 17: pulse with result_backend = "pulse://" ran (every result checked in the store).
    assert "pulse + pulse:// vs pulse without results" in page
    assert page.count("**What this means.**") >= 9
    # Raw results and the plots the page links to.
    results = json.loads((out / "benchmarks.json").read_text())
    assert not [k for k, v in results["sections"].items() if "error" in v]
    for image in ("throughput", "cpu_per_task", "sql_cost", "store_scale", "recovery",
                  "failover", "lease_loss", "memory", "permits"):
        png = out / "img" / f"{image}.png"
        assert png.stat().st_size > 1000, png
        assert f"img/{image}.png" in page
    check_permits(page, results["sections"]["permits"])


def check_permits(page: str, pm: dict[str, Any]) -> None:
    """Issue 19's section: every row measured, limits kept, nothing left held or waiting."""
    section = page.split("## 9. Concurrency permits", 1)[1].split("\n## ", 1)[0]
    for label in pm["workloads"].values():
        for kind in ("unlimited", "limit 1,000", "limit 2", "limit 1"):
            assert f"| {label} | {kind} |" in section, (label, kind)
    assert "**unlimited**" in section and "**limit 1,000**" in section
    assert "Issue 19: permits held, tasks waiting or claims live after the runs" in page
    rows = pm["summary"]
    assert len(rows) == 4 * len(pm["workloads"])
    for row in rows:
        what = (row["workload"], row["variant"])
        assert row["rate"] > 0, what
        assert 1 <= row["most_at_once"] <= pm["concurrency"], what
        if row["limit"] is not None:
            assert row["most_at_once"] <= row["limit"], what
            assert row["ratio"] is not None and row["ratio"] > 0, what
        assert (row["held_left"], row["waiting_left"], row["live_left"]) == (0, 0, 0), what
    for run in pm["runs"]:
        assert run["spans"] == run["succeeded"] == run["n"], run
