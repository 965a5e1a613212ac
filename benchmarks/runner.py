"""Runs the benchmark sections in order, then writes the report. Kills what it started."""

from __future__ import annotations

import atexit
import datetime
import json
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa

from benchmarks import (
    checkpoints,
    drivers,
    failover,
    gateway,
    infra,
    leaseloss,
    memory,
    permits,
    profile,
    rates,
    recovery,
    report,
    retention,
    scale,
    sqlcost,
    throughput,
    wakeup,
)

SECTIONS: dict[str, Callable[[infra.Scratch, bool], dict[str, Any]]] = {
    "throughput": throughput.run,
    "profile": profile.run,
    "sqlcost": sqlcost.run,
    "scale": scale.run,
    "recovery": recovery.run,
    "failover": failover.run,
    "leaseloss": leaseloss.run,
    "drivers": drivers.run,
    "permits": permits.run,
    "gateway": gateway.run,
    "retention": retention.run,
    "memory": memory.run,
    "wakeup": wakeup.run,
    "rates": rates.run,
    "checkpoints": checkpoints.run,
}

#: Sections run only when named in ``--only`` (the memory one takes 10-40 minutes).
OPT_IN = ("memory",)


def _mariadb_address() -> tuple[str, int]:
    url = sa.make_url(infra.MARIADB_URL)  # $PULSE_BENCH_MARIADB
    return url.host or "127.0.0.1", url.port or 3306


SERVICES = {"PostgreSQL": ("127.0.0.1", 5432), "MariaDB": _mariadb_address(),
            "RabbitMQ": ("127.0.0.1", 5672), "Redis": ("127.0.0.1", 6379)}


def _revision() -> str:
    """The last commit that touched celery_pulse/ (and whether the tree differs from it)."""
    try:
        head = subprocess.run(["git", "-C", str(infra.ROOT), "log", "-1", "--format=%h",
                               "--", "celery_pulse"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(infra.ROOT), "status", "--porcelain",
                                "celery_pulse"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "an unknown revision"
    if not head:
        return "an unknown revision"
    return f"commit `{head}`" + (" with uncommitted changes" if dirty else "")


def package_fingerprint() -> str:
    """A hash of every source file of celery_pulse/ (detects edits made during a run)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((infra.ROOT / "celery_pulse").rglob("*.py")):
        digest.update(str(path.relative_to(infra.ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def check_services() -> None:
    import socket

    missing = []
    for name, (host, port) in SERVICES.items():
        try:
            with socket.create_connection((host, port), timeout=2):
                pass
        except OSError:
            missing.append(f"{name} ({host}:{port})")
    if missing:
        raise SystemExit("benchmarks need these services running: " + ", ".join(missing))


def run(*, quick: bool, output: str | None, only: list[str] | None, with_profile: bool,
        keep_scratch: bool, argv: list[str]) -> int:
    names = [n for n in SECTIONS if n not in OPT_IN or (only and n in only)]
    if only:
        unknown = [n for n in only if n not in SECTIONS]
        if unknown:
            raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
        names = [n for n in names if n in only]
    if not with_profile and "profile" in names:
        names.remove("profile")
    out_dir = Path(output) if output else infra.ROOT / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    check_services()
    atexit.register(infra.kill_all)
    previous = signal.signal(signal.SIGTERM, _on_signal)
    scratch = infra.Scratch(keep=keep_scratch)
    started = time.monotonic()
    load_start = infra.load_average()
    revision = _revision()  # at the start: the package may change while this runs
    fingerprint = package_fingerprint()
    results: dict[str, Any] = {"sections": {}, "meta": {}}
    timings: dict[str, float] = {}
    failed = False
    try:
        infra.log(f"{'quick' if quick else 'full'} run: {', '.join(names)} "
                  f"(load average {load_start[0]:.2f}); scratch {scratch.dir}")
        infra.purge_redis_db()
        for name in names:
            t0 = time.monotonic()
            try:
                results["sections"][name] = SECTIONS[name](scratch, quick)
            except KeyboardInterrupt:
                raise
            except Exception:
                failed = True
                text = traceback.format_exc()
                infra.log(f"section {name} failed:\n{text}")
                results["sections"][name] = {"error": text}
            finally:
                infra.kill_all()
                timings[name] = time.monotonic() - t0
                infra.log(f"section {name}: {timings[name]:.0f}s")
    finally:
        infra.kill_all()
        signal.signal(signal.SIGTERM, previous)
        if not keep_scratch:
            scratch.close()
        else:
            infra.log(f"scratch kept: {scratch.dir}")
    results["meta"] = {
        "command": " ".join(argv), "quick": quick,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": infra.machine_info(), "load_start": load_start,
        "load_end": infra.load_average(), "runtime_s": time.monotonic() - started,
        "section_seconds": timings, "revision": revision,
        "package_fingerprint": fingerprint,
        "package_changed_during_run": package_fingerprint() != fingerprint,
    }
    (out_dir / "benchmarks.json").write_text(json.dumps(results, indent=1, default=str))
    path = report.write_markdown(results, out_dir)
    print(report.console_table(report.summary_rows(results), report.SUMMARY_HEADER))
    print(f"\nload average {load_start[0]:.2f} -> {results['meta']['load_end'][0]:.2f}; "
          f"{results['meta']['runtime_s'] / 60:.1f} min; wrote {path} and {out_dir / 'img'}/")
    return 1 if failed else 0
