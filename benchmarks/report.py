"""Turn the runner's results into a console table, ``benchmarks.md`` and PNG plots.

Every number written here comes from the results dict the runner measured; the
prose around it is chosen by those numbers (a target met or missed reads differently).
"""

from __future__ import annotations

import functools
import statistics
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import retention, wakeup

STORE_LABEL = {"prefork": "prefork", "pulse-postgres": "pulse · PostgreSQL",
               "pulse-sqlite": "pulse · SQLite", "pulse-mariadb": "pulse · MariaDB",
               "prefork-sqla": "prefork + SQLAlchemy result backend · PostgreSQL",
               "procrastinate": "procrastinate 3 · PostgreSQL",
               "prefork-redis": "prefork + Redis result backend",
               "pulse-redis": "pulse · PostgreSQL + Redis result backend",
               "pulse-results": "pulse · PostgreSQL + pulse:// result backend"}
PEERS = ("prefork-sqla", "procrastinate")
#: Result backends, every result stored (issue 17).
RESULTS = ("prefork-redis", "pulse-redis", "pulse-results")
#: pulse on each store; results of older runs may lack some (then they are left out).
PULSE_STORES = ("pulse-postgres", "pulse-sqlite", "pulse-mariadb")
VARIANTS = ("prefork", *PULSE_STORES)
#: The server stores of section 2 (SQL cost): PostgreSQL's figures are at the top level
#: of its results, MariaDB's under "mariadb".
SQL_STORES = {"postgres": "PostgreSQL", "mariadb": "MariaDB"}
#: Issue 15's targets for the redesigned hot path (DESIGN §5 asks 0.9x for every case).
NOOP_TARGET, WORK_TARGET, PEER_TARGET, PARENT_CPU_TARGET = 0.5, 0.95, 2.0, 0.8
#: Issue 17's: pulse + pulse:// vs prefork + SQLAlchemy backend, and vs pulse without results.
RESULTS_VS_SQLA_TARGET, RESULTS_VS_PLAIN_TARGET = 2.0, 0.9
BROKER_LABEL = {"rabbitmq": "RabbitMQ", "redis": "Redis"}
COLORS = {"prefork": "#8c8c8c", "pulse-postgres": "#1f77b4", "pulse-sqlite": "#ff7f0e",
          "pulse-mariadb": "#17becf",
          "prefork-sqla": "#9467bd", "procrastinate": "#2ca02c",
          "prefork-redis": "#bcbd22", "pulse-redis": "#e377c2", "pulse-results": "#8c564b",
          "pulse": "#1f77b4", "redbeat": "#d62728", "celery": "#8c8c8c"}
THROUGHPUT_TARGET = 0.9
X = "\u00d7"  # multiplication sign


# -- small formatting helpers ----------------------------------------------------------------
def s(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f} s"


def num(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}{X}"


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**missed**")


def _ok(section: dict[str, Any] | None) -> bool:
    return section is not None and bool(section) and "error" not in section \
        and "skipped" not in section


def store_cpu(cpu: dict[str, float]) -> float:
    """CPU ms per task of the store server (``postgres`` in results of older runs)."""
    return cpu.get("store", cpu.get("postgres", 0.0))


def sql_stores(sq: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(store, figures) of section 2 for each server store measured (older runs:
    PostgreSQL only)."""
    out = [("postgres", sq)]
    if _ok(sq.get("mariadb")):
        out.append(("mariadb", sq["mariadb"]))
    return out


# -- summary rows ----------------------------------------------------------------------------
def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    """[what, pulse, baseline, ratio/value, target, verdict] rows."""
    rows: list[list[str]] = []
    sec = results["sections"]
    tp = sec.get("throughput")
    if _ok(tp):
        labels = tp["workloads"]
        for row in tp["summary"]:
            if row["variant"] == "prefork" or row["variant"] in PEERS + RESULTS:
                continue
            base = next(r for r in tp["summary"] if r["variant"] == "prefork"
                        and r["broker"] == row["broker"] and r["workload"] == row["workload"])
            rows.append([f"Throughput, {labels[row['workload']]}, {BROKER_LABEL[row['broker']]}, "
                         f"{STORE_LABEL[row['variant']].split(' · ')[1]} store",
                         f"{num(row['rate'])} tasks/s", f"{num(base['rate'])} tasks/s (prefork)",
                         ratio(row["ratio"]), f"≥ {THROUGHPUT_TARGET}{X}",
                         verdict(row["ratio"] is not None and row["ratio"] >= THROUGHPUT_TARGET)])
        rows += hot_path_rows(tp)
        rows += results_rows(tp)
        pulse_mem = [r for r in tp["summary"] if r["variant"] == "pulse-postgres"]
        base_mem = [r for r in tp["summary"] if r["variant"] == "prefork"]
        if pulse_mem and base_mem:
            p = statistics.median(r["pss_mb"] for r in pulse_mem)
            b = statistics.median(r["pss_mb"] for r in base_mem)
            rows.append([f"Memory (PSS, whole worker, -c {tp['concurrency']})", f"{p:.0f} MB",
                         f"{b:.0f} MB (prefork)", ratio(p / b), "—", "—"])
    sq = sec.get("sqlcost")
    if _ok(sq):
        for store, data in sql_stores(sq):
            rows += sql_rows(store, data)
    sc = sec.get("scale")
    if _ok(sc) and sc["points"]:
        top = sc["points"][-1]
        rows.append([f"Renew latency, {top['workers']} workers {X} {sc['leases_per_worker']} leases",
                     f"p50 {top['renew_p50_ms']:.1f} ms, p99 {top['renew_p99_ms']:.1f} ms",
                     "—", f"PostgreSQL CPU {top['pg_cpu_percent']:.0f}% of a core", "—", "—"])
    rc = sec.get("recovery")
    if _ok(rc):
        base = {(c["broker"], c["task"]): c for c in rc["cases"] if c["pool"] == "prefork"}
        for case in rc["cases"]:
            if case["pool"] != "pulse":
                continue
            plain = base.get((case["broker"], case["task"]))
            if plain is None and case["broker"] == "redis":
                plain = next((c for c in rc["stated"] if c["broker"] == "redis"), None)
            if plain is None:
                baseline = "—"
            elif plain.get("stated"):
                baseline = f"{plain['seconds']:,.0f} s (visibility_timeout, stated)"
            elif plain["seconds"] is None:
                baseline = "never (lost)"
            else:
                baseline = s(plain["seconds"])
            what = "needs_review" if case["outcome"] == "needs_review" else "re-run"
            rows.append([f"SIGKILL → {what}, {'acks_late' if case['acks_late'] else 'default acks'}, "
                         f"{BROKER_LABEL[case['broker']]}", s(case["seconds"]), baseline,
                         "—", f"≤ {rc['bound']:g} s",
                         verdict(case["seconds"] is not None and case["seconds"] <= rc["bound"])])
        lost = sum(c["prefetched_lost"] for c in rc["cases"] if c["pool"] == "pulse")
        total = sum(c["prefetched"] for c in rc["cases"] if c["pool"] == "pulse")
        rows.append(["Prefetched messages lost on SIGKILL (pulse, all cases)", f"{lost} of {total}",
                     "—", "—", "0", verdict(lost == 0)])
    fo = sec.get("failover")
    if _ok(fo):
        for event in ("crash", "handover"):
            pulse = [c for c in fo["cases"] if c["event"] == event and c["scenario"].startswith("pulse")]
            for case in pulse:
                twin = next((c for c in fo["cases"] if c["event"] == event and c["scenario"]
                             == case["scenario"].replace("pulse", "redbeat")), None)
                took = case["takeover_s"]
                rows.append([f"Leader {'crash (SIGKILL)' if event == 'crash' else 'handover (SIGTERM)'}"
                             f" → next tick, {case['label'].split(', ', 1)[1]}", s(took),
                             (_takeover(twin) + " (RedBeat " + twin["label"].split(", ", 1)[1] + ")")
                             if twin else "—", "—", f"≤ {case['expected_s']:g} s",
                             verdict(took is not None and took <= case["expected_s"])])
        dup = sum(c["duplicates"] for c in fo["cases"] if c["scenario"].startswith("pulse"))
        rows.append(["Periodic slots fired twice across failovers (pulse)", str(dup), "—", "—", "0",
                     verdict(dup == 0)])
    pm = sec.get("permits")
    if _ok(pm):
        rows += permits_rows(pm)
    rt = sec.get("retention")
    if _ok(rt):
        rows += retention.summary_rows(rt)
    mem = sec.get("memory")
    if _ok(mem):
        pulse = [r for r in mem["runs"] if r["variant"] != "prefork"]
        base = next((r for r in mem["runs"] if r["variant"] == "prefork"), None)
        worst = max(pulse, key=lambda r: r["diff"]) if pulse else None
        if worst is not None:
            rows.append([f"Parent RSS growth over the 2nd half of {mem['n']:,} no-op tasks "
                         f"(worst store: {STORE_LABEL.get(worst['variant'], '?')})",
                         f"{worst['diff']:.0f} B/task",
                         f"{base['diff']:.0f} B/task" if base else "—", "—",
                         f"≤ {mem['limit']:g} B/task", verdict(mem["ok"])])
    ll = sec.get("leaseloss")
    if _ok(ll):
        rows.append(["Store-side takeover → LeaseLost in the task (median / max)",
                     f"{ll['takeover_median_s']:.2f} / {ll['takeover_max_s']:.2f} s", "—", "—",
                     f"≤ {ll['bound_s']:g} s", verdict(ll["takeover_max_s"] <= ll["bound_s"])])
        hard = ll["hard_stop"]
        rows.append(["Takeover → hard stop of a task ignoring LeaseLost", s(hard["hard_stop_s"]), "—",
                     f"{hard['after_lease_lost_s']:.2f} s after LeaseLost",
                     f"≤ {ll['bound_s'] + ll['conf']['pulse_revoke_grace']:g} s",
                     verdict(hard["hard_stop_s"] <= ll["bound_s"] + ll["conf"]["pulse_revoke_grace"])])
        out = ll["outage"]
        rows.append(["Store outage → LeaseLost (self-fence)", s(out["lease_lost_s"]), "—",
                     f"{out['before_store_expiry_s']:.2f} s before the store's expiry",
                     "before the store's expiry", verdict(out["before_store_expiry_s"] > 0)])
    return rows


def sql_rows(store: str, sq: dict[str, Any]) -> list[list[str]]:
    """Section 2's summary rows for one server store.

    Issue 15's targets (≤ 1 statement and ≤ 1 round trip per task, one renewal statement
    per interval) are those of PostgreSQL's pipelined hot path. On MariaDB every operation
    is a transaction of several statements (a read under lock, the write, a read back,
    COMMIT), sent in one packet where the exchange is a usual one: its rows are held to
    DESIGN's ≤ 3 statements per task and to renewal staying one transaction per interval
    whatever the number of leases.
    """
    name = SQL_STORES[store]
    renewals = sq["renew_calls_per_second"] * sq["renew_interval"]
    per_statement = f"{sq['renew_rows_per_call'] or 0:.0f} leases per statement"
    if store == "postgres":
        return [
            [f"SQL statements per task, {name} (reserve + start + complete, amortised)",
             f"{sq['per_task_lifecycle']:.2f}", "—", f"{sq['per_task_lifecycle']:.2f}",
             "≤ 1 under load (issue 15; DESIGN ≤ 3)", verdict(sq["per_task_lifecycle"] <= 1)],
            [f"SQL round trips per task, {name}, everything included",
             f"{sq['per_task_total']:.2f}", "—", f"{sq['per_task_total']:.2f}",
             "≤ 1 under load", verdict(sq["per_task_total"] <= 1.0)],
            [f"Renewal statements per interval, {name}, {sq['held_leases']} leases held",
             f"{renewals:.2f}", "—", per_statement, "O(1)", verdict(renewals <= 1.25)],
            [f"SQL statements per idle worker per second, {name}",
             f"{sq['idle_total_per_second']:.1f}", "—", "—", "—", "—"]]
    commits = sq["per_task"].get("begin/commit", 0.0)
    return [
        [f"SQL statements per task, {name} (reserve + start + complete, amortised)",
         f"{sq['per_task_lifecycle']:.2f}", "—",
         f"+ {commits:.2f} COMMIT/ROLLBACK", "≤ 3 under load (DESIGN)",
         verdict(sq["per_task_lifecycle"] <= 3)],
        [f"SQL round trips per task, {name}, everything included",
         f"{sq['per_task_total']:.2f}", "—", "a packet per usual exchange",
         "≤ 0.5 under load (issue 41)", verdict(sq["per_task_total"] <= 0.5)],
        [f"Renewal statements per interval, {name}, {sq['held_leases']} leases held",
         f"{renewals:.2f}", "—", per_statement, "O(1)",
         verdict((sq["renew_rows_per_call"] or 0) >= 0.9 * sq["held_leases"])],
        [f"SQL statements per idle worker per second, {name}",
         f"{sq['idle_total_per_second']:.1f}", "—", "—", "—", "—"]]


def _find(tp: dict[str, Any], variant: str, workload: str, broker: str = "rabbitmq"
          ) -> dict[str, Any] | None:
    return next((r for r in tp["summary"] if r["variant"] == variant
                 and r["workload"] == workload and r["broker"] == broker), None)


def hot_path_rows(tp: dict[str, Any]) -> list[list[str]]:
    """Issue 15's targets: no-ops at half of prefork, 10 ms tasks at par, twice the peers."""
    rows: list[list[str]] = []
    labels = tp["workloads"]
    noop = "noop-2000" if "noop-2000" in labels else "noop-500"
    pulse, base = _find(tp, "pulse-postgres", noop), _find(tp, "prefork", noop)
    if pulse and base:
        rows.append([f"Issue 15: {labels[noop]}, PostgreSQL store, default acks, vs prefork",
                     f"{num(pulse['rate'])} tasks/s", f"{num(base['rate'])} tasks/s",
                     ratio(pulse["ratio"]), f"≥ {NOOP_TARGET}{X}",
                     verdict(pulse["ratio"] is not None and pulse["ratio"] >= NOOP_TARGET)])
        cpu = pulse["cpu_ms_per_task"]["parent"]
        rows.append(["Issue 15: CPU of the worker's parent per no-op task", f"{cpu:.2f} ms",
                     f"{base['cpu_ms_per_task']['parent']:.2f} ms (prefork)", "—",
                     f"≤ {PARENT_CPU_TARGET} ms", verdict(cpu <= PARENT_CPU_TARGET)])
    for peer in PEERS:
        other = _find(tp, peer, noop)
        if pulse and other:
            rows.append([f"Issue 15: {labels[noop]}, pulse (PostgreSQL) vs {STORE_LABEL[peer]}",
                         f"{num(pulse['rate'])} tasks/s", f"{num(other['rate'])} tasks/s",
                         ratio(pulse["rate"] / other["rate"]), f"≥ {PEER_TARGET}{X}",
                         verdict(pulse["rate"] >= PEER_TARGET * other["rate"])])
    for key in ("sleep-1000", "sleep-late-1000", "sleep-200"):
        for variant in PULSE_STORES:
            row = _find(tp, variant, key)
            if row is None or row["ratio"] is None:
                continue
            rows.append([f"Issue 15: {labels[key]}, {STORE_LABEL[variant].split(' · ')[1]} "
                         f"store, vs prefork", f"{num(row['rate'])} tasks/s", "—",
                         ratio(row["ratio"]), f"≥ {WORK_TARGET}{X}",
                         verdict(row["ratio"] >= WORK_TARGET)])
    return rows


def versus(row: dict[str, Any], other: dict[str, Any]) -> float:
    """``row``'s rate over ``other``'s: the median of per-repeat ratios where the runner
    measured them (``vs``), else the ratio of the medians."""
    value: float = row.get("vs", {}).get(other["variant"], row["rate"] / other["rate"])
    return value


def results_rows(tp: dict[str, Any]) -> list[list[str]]:
    """Issue 17's targets: pulse + pulse:// at twice prefork + SQLAlchemy backend, and
    within 10% of pulse without results (no-op tasks, RabbitMQ)."""
    rows: list[list[str]] = []
    labels = tp["workloads"]
    noop = "noop-2000" if "noop-2000" in labels else "noop-500"
    mine = _find(tp, "pulse-results", noop)
    if mine is None:
        return rows
    for other, what, target in (
            ("prefork-sqla", "prefork + SQLAlchemy backend", RESULTS_VS_SQLA_TARGET),
            ("pulse-postgres", "pulse without results", RESULTS_VS_PLAIN_TARGET)):
        theirs = _find(tp, other, noop)
        if theirs is None:
            continue
        value = versus(mine, theirs)
        rows.append([f"Issue 17: {labels[noop]}, pulse + pulse:// vs {what}",
                     f"{num(mine['rate'])} tasks/s", f"{num(theirs['rate'])} tasks/s",
                     ratio(value), f"≥ {target}{X}", verdict(value >= target)])
    return rows


#: The permits section's variants (issue 19), and what each row means.
PERMIT_VARIANTS = ("unlimited", "limit-1000", "limit-2", "limit-1")


def permit_label(variant: str) -> str:
    """``unlimited``, ``limit 1,000``, ..."""
    return variant if variant == "unlimited" else f"limit {int(variant.split('-')[1]):,}"


def _permit_row(pm: dict[str, Any], workload: str, variant: str) -> dict[str, Any] | None:
    return next((r for r in pm["summary"] if r["workload"] == workload
                 and r["variant"] == variant), None)


def _permit_overrun(pm: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows where more bodies ran at once than the limit allows."""
    return [r for r in pm["summary"] if r["limit"] is not None
            and r["most_at_once"] > r["limit"]]


def permits_rows(pm: dict[str, Any]) -> list[list[str]]:
    """Issue 19: what a limit that never binds costs, limit 1 on timed tasks, and the
    limits kept (no overrun, nothing left held)."""
    rows: list[list[str]] = []
    labels = pm["workloads"]
    for workload in labels:
        base = _permit_row(pm, workload, "unlimited")
        for variant in ("limit-1000", "limit-1"):
            row = _permit_row(pm, workload, variant)
            if base is None or row is None or (variant == "limit-1"
                                               and not workload.startswith("sleep")):
                continue
            what = ("a limit that never binds (1,000)" if variant == "limit-1000"
                    else "limit 1 (one at a time)")
            rows.append([f"Issue 19: {labels[workload]}, {what}, vs the unlimited kind",
                         f"{num(row['rate'])} tasks/s", f"{num(base['rate'])} tasks/s",
                         ratio(row["ratio"]), "—", "—"])
    over = _permit_overrun(pm)
    limited = [r for r in pm["summary"] if r["limit"] is not None]
    rows.append(["Issue 19: most tasks running at once above their limit (all runs)",
                 str(max((r["most_at_once"] - r["limit"] for r in limited), default=0)
                     if over else 0), "—", "—", "0", verdict(not over)])
    left = sum(r["held_left"] + r["waiting_left"] + r["live_left"] for r in pm["summary"])
    rows.append(["Issue 19: permits held, tasks waiting or claims live after the runs",
                 str(left), "—", "—", "0", verdict(left == 0)])
    return rows


def _takeover(case: dict[str, Any] | None) -> str:
    if case is None:
        return "—"
    if case["takeover_s"] is None:
        return f"> {case['cap_s']:g} s"
    return s(case["takeover_s"])


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def console_table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header, *[[c.replace("**", "") for c in r] for r in rows]]
    widths = [min(60, max(len(r[i]) for r in cells)) for i in range(len(header))]
    out = []
    for i, r in enumerate(cells):
        out.append("  ".join(c[:widths[j]].ljust(widths[j]) for j, c in enumerate(r)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


SUMMARY_HEADER = ["What", "pulse", "Baseline", "Ratio / detail", "Target", "Verdict"]


# -- plots -----------------------------------------------------------------------------------
def _save(fig: Any, img: Path, name: str) -> str:
    img.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(img / name, dpi=110)
    plt.close(fig)
    return f"img/{name}"


def plot_throughput(tp: dict[str, Any], img: Path) -> str:
    groups = [(r["broker"], r["workload"]) for r in tp["summary"] if r["variant"] == "prefork"]
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in tp["summary"])]
    pulse = [v for v in variants if v != "prefork"]
    fig, (left, right) = plt.subplots(2, 1, figsize=(11, 8.5))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        rates, ratios = [], []
        for broker, workload in groups:
            row = next((r for r in tp["summary"] if r["broker"] == broker
                        and r["workload"] == workload and r["variant"] == variant), None)
            rates.append(row["rate"] if row else 0)
            ratios.append(row["ratio"] if row and row["ratio"] is not None else 0)
        xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(groups))]
        left.bar(xs, rates, width, label=STORE_LABEL[variant], color=COLORS[variant])
        if variant != "prefork":
            j = pulse.index(variant) - (len(pulse) - 1) / 2
            right.bar([g + j * width for g in range(len(groups))], ratios, width,
                      label=STORE_LABEL[variant], color=COLORS[variant])
    names = [f"{tp['workloads'][w].replace(', ', chr(10))}\n{BROKER_LABEL[b]}"
             for b, w in groups]
    left.set_xticks(range(len(groups)), names, fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("tasks / s (log scale)")
    left.set_title(f"Throughput, -c {tp['concurrency']} (median)")
    left.legend(fontsize=8)
    right.axhline(THROUGHPUT_TARGET, color="green", linestyle="--", label=f"target 0.9{X}")
    right.set_xticks(range(len(groups)), names, fontsize=8)
    right.set_ylim(0, max(1.1, *(r["ratio"] or 0 for r in tp["summary"])))
    right.set_ylabel("pulse / prefork")
    right.set_title("Ratio to plain prefork")
    right.legend(fontsize=8)
    return _save(fig, img, "throughput.png")


def plot_cpu(tp: dict[str, Any], img: Path) -> str:
    rows = [r for r in tp["summary"] if r["workload"] == tp["summary"][0]["workload"]]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(rows)), 4.4))
    labels = [f"{textwrap.fill(STORE_LABEL[r['variant']], 18)}\n{BROKER_LABEL[r['broker']]}"
              for r in rows]
    bottom = [0.0] * len(rows)
    for part, color in (("parent", "#4c72b0"), ("children", "#55a868"), ("store", "#c44e52")):
        values = [store_cpu(r["cpu_ms_per_task"]) if part == "store" else
                  r["cpu_ms_per_task"][part] for r in rows]
        ax.bar(labels, values, bottom=bottom, color=color, label={
            "parent": "worker parent (consumer loop + pulse threads)",
            "children": "pool children",
            "store": "store server (PostgreSQL backends; MariaDB, Redis: whole server, "
                     "shared)"}[part])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("CPU ms per task")
    ax.set_title(f"Where the CPU goes, {tp['workloads'][rows[0]['workload']]} (median)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, img, "cpu_per_task.png")


def plot_sql(sq: dict[str, Any], img: Path) -> str:
    stores = sql_stores(sq)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    height = 0.8 / len(stores)
    for ax, key, threshold in ((left, "per_task", 0.005), (right, "idle_per_second", 0.001)):
        kinds = [k for k in stores[0][1][key] if any(d[key].get(k, 0) > threshold
                                                     for _, d in stores)]
        for i, (store, data) in enumerate(stores):
            ys = [y + (i - (len(stores) - 1) / 2) * height for y in range(len(kinds))]
            ax.barh(ys, [data[key].get(k, 0) for k in kinds], height,
                    label=SQL_STORES[store], color=COLORS[f"pulse-{store}"])
        ax.set_yticks(range(len(kinds)), kinds)
        ax.invert_yaxis()
    left.axvline(1, color="orange", linestyle=":", label="target ≤ 1 statement (PostgreSQL)")
    left.set_xlabel("statements per task")
    left.set_title(f"Under load ({sq['n']:,} no-op tasks)")
    left.legend(fontsize=8)
    right.set_xlabel("statements per second")
    right.set_title("One idle worker")
    right.legend(fontsize=8)
    return _save(fig, img, "sql_cost.png")


def plot_scale(sc: dict[str, Any], img: Path) -> str:
    pts = sc["points"]
    xs = [p["workers"] for p in pts]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, [p["renew_p50_ms"] for p in pts], "o-", label="renew p50")
    ax.plot(xs, [p["renew_p99_ms"] for p in pts], "s-", label="renew p99")
    ax.set_xlabel(f"simulated workers (each {sc['leases_per_worker']} leases, renewing every "
                  f"{sc['interval']:g} s)")
    ax.set_ylabel("renew latency (ms)")
    twin = ax.twinx()
    twin.plot(xs, [p["pg_cpu_percent"] for p in pts], "^--", color="#c44e52",
              label="PostgreSQL CPU")
    twin.set_ylim(0, max(10.0, *(p["pg_cpu_percent"] * 1.2 for p in pts)))
    twin.set_ylabel("PostgreSQL CPU (% of one core)")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")
    ax.set_title("Store scale: batched renewals")
    return _save(fig, img, "store_scale.png")


def plot_recovery(rc: dict[str, Any], img: Path) -> str:
    cases = [*rc["cases"], *rc["stated"]]
    labels, values, colors, hatches = [], [], [], []
    for c in cases:
        pool = "pulse" if c["pool"] == "pulse" else "Celery"
        what = "review" if c.get("outcome") == "needs_review" else (
            "acks_late" if c["acks_late"] else "default acks")
        labels.append(f"{pool}, {BROKER_LABEL[c['broker']]}, {what}")
        lost = c["seconds"] is None
        values.append(c["seconds"] if not lost else 3600.0)
        colors.append(COLORS["pulse"] if c["pool"] == "pulse" else COLORS["celery"])
        hatches.append("//" if c.get("stated") or lost else "")
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(cases) + 1.4))
    bars = ax.barh(labels, values, color=colors)
    for bar, hatch, c in zip(bars, hatches, cases, strict=True):
        bar.set_hatch(hatch)
        text = ("never (lost)" if c["seconds"] is None else
                f"{c['seconds']:,.0f} s (stated)" if c.get("stated") else f"{c['seconds']:.2f} s")
        ax.text(bar.get_width() * 1.1, bar.get_y() + bar.get_height() / 2, text, va="center",
                fontsize=8)
    ax.axvline(rc["bound"], color="green", linestyle="--", label=f"pulse target {rc['bound']:g} s")
    ax.set_xscale("log")
    ax.set_xlim(0.005, 40000)
    ax.set_xlabel("SIGKILL → task runs again / needs_review (s, log scale)")
    ax.legend(fontsize=8, loc="lower right")
    ax.invert_yaxis()
    return _save(fig, img, "recovery.png")


def plot_failover(fo: dict[str, Any], img: Path) -> str:
    cases = fo["cases"]
    horizon = min(30.0, max([8.0, *(t + 2 for c in cases for t in c["ticks"])]))
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(cases) + 1.6))
    for i, c in enumerate(cases):
        color = COLORS["pulse"] if c["scenario"].startswith("pulse") else COLORS["redbeat"]
        ticks = [t for t in c["ticks"] if t <= horizon]
        ax.scatter(ticks, [i] * len(ticks), s=18, color=color)
        if c["takeover_s"] is not None:
            ax.plot([0, c["takeover_s"]], [i, i], color=color, alpha=0.35, linewidth=3)
        ax.text(horizon + 0.2, i, _takeover(c), va="center", fontsize=8)
    ax.axvline(0, color="black", linewidth=1)
    ax.set_yticks(range(len(cases)),
                  [f"{c['label']} - {c['event']}" for c in cases], fontsize=8)
    ax.set_xlim(-3.5, horizon + 2.5)
    ax.set_xlabel("seconds after SIGKILL / SIGTERM of the leader (each dot: one tick published)")
    ax.set_title(f"Leader failover, {fo['period']:g} s schedule (label: signal → first tick "
                 f"from the new leader)")
    ax.invert_yaxis()
    return _save(fig, img, "failover.png")


def plot_leaseloss(ll: dict[str, Any], img: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.4))
    rows = [("takeover → LeaseLost", ll["takeover_s"], ll["bound_s"]),
            ("takeover → hard stop", [ll["hard_stop"]["hard_stop_s"]],
             ll["bound_s"] + ll["conf"]["pulse_revoke_grace"]),
            ("store outage → LeaseLost", [ll["outage"]["lease_lost_s"]], ll["self_fence_s"])]
    for i, (label, values, bound) in enumerate(rows):
        ax.scatter(values, [i] * len(values), color="#1f77b4", zorder=3)
        ax.plot([bound, bound], [i - 0.3, i + 0.3], color="green", linestyle="--")
        ax.text(bound, i - 0.35, f"bound {bound:g} s", fontsize=7, color="green", ha="center")
        del label
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_xlim(0, max(r[2] for r in rows) + 1.5)
    ax.set_xlabel("seconds")
    ax.set_title(f"Lease loss reaction (lease_ttl {ll['conf']['pulse_lease_ttl']:g} s, renew "
                 f"{ll['renew_interval']:g} s, revoke_grace {ll['conf']['pulse_revoke_grace']:g} s)")
    ax.invert_yaxis()
    return _save(fig, img, "lease_loss.png")


def plot_memory(tp: dict[str, Any], img: Path) -> str:
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in tp["summary"])]
    rows = {v: [r for r in tp["summary"] if r["variant"] == v] for v in variants}
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(variants), 3.4))
    xs = range(len(variants))
    rss = [statistics.median(r["rss_mb"] for r in rows[v]) if rows[v] else 0 for v in variants]
    pss = [statistics.median(r["pss_mb"] for r in rows[v]) if rows[v] else 0 for v in variants]
    ax.bar([x - 0.2 for x in xs], rss, 0.4, label="RSS (sum over processes)", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], pss, 0.4, label="PSS (shared pages split)", color="#55a868")
    ax.set_xticks(list(xs), [STORE_LABEL[v] for v in variants])
    ax.set_ylabel("MB")
    ax.set_title(f"Worker memory, -c {tp['concurrency']}, after a run (median)")
    ax.set_ylim(0, 1.3 * max([1.0, *rss, *pss]))  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    return _save(fig, img, "memory.png")


def plot_permits(pm: dict[str, Any], img: Path) -> str:
    workloads = list(pm["workloads"])
    variants = [v for v in PERMIT_VARIANTS if any(r["variant"] == v for r in pm["summary"])]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(variants)
    colors = dict(zip(PERMIT_VARIANTS, ("#8c8c8c", "#1f77b4", "#ff7f0e", "#d62728"),
                      strict=True))
    for i, variant in enumerate(variants):
        xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(workloads))]
        rows = [_permit_row(pm, w, variant) for w in workloads]
        values = [r["ratio"] if r and r["ratio"] is not None else 0 for r in rows]
        bars = ax.bar(xs, values, width, label=permit_label(variant), color=colors[variant])
        for bar, row in zip(bars, rows, strict=True):
            if row:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.02,
                        f"{num(row['rate'])}/s", ha="center", fontsize=7)
    ax.axhline(0.5, color="#d62728", linestyle=":", linewidth=1,
               label=f"0.5{X}: one of {pm['concurrency']} processes at work")
    ax.set_xticks(range(len(workloads)), [pm["workloads"][w] for w in workloads])
    top = max([1.0, *(r["ratio"] or 0 for r in pm["summary"])])
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.set_ylabel("tasks/s vs the unlimited kind")
    ax.set_title(f"A limited task kind vs an unlimited one, -P pulse -c {pm['concurrency']} "
                 f"(median of per-repeat ratios; labels: tasks/s)")
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    return _save(fig, img, "permits.png")


# -- the markdown ----------------------------------------------------------------------------
def _section(lines: list[str], results: dict[str, Any], key: str, title: str,
             body: Callable[[dict[str, Any], list[str]], None]) -> None:
    lines += ["", f"## {title}", ""]
    data = results["sections"].get(key)
    if data is None:
        lines.append("_Not run in this invocation._")
    elif "error" in data:
        lines += ["This section failed in this run:", "", "```", data["error"][-2000:], "```"]
    elif "skipped" in data:
        lines.append(f"_Skipped: {data['skipped']}_")
    else:
        body(data, lines)


def write_markdown(results: dict[str, Any], out_dir: Path) -> Path:
    img = out_dir / "img"
    meta = results["meta"]
    m = meta["machine"]
    lines = [
        "# Benchmarks",
        "",
        "This page is generated by the benchmark runner: every figure, table and plot on it "
        "comes from one run on the machine described below, nothing is typed in by hand. "
        "Re-run it to refresh the page:",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"Mode: **{'quick' if meta['quick'] else 'full'}**, run on {meta['date']} in "
        f"{meta['runtime_s'] / 60:.1f} minutes. celery_pulse at {meta['revision']} (source "
        f"fingerprint `{meta.get('package_fingerprint', '?')}`)."
        + (" **Warning: celery_pulse/ was edited while this run went on; its sections may "
           "have measured different versions.**" if meta.get("package_changed_during_run")
           else ""),
        "",
        "| Machine | |",
        "| --- | --- |",
        f"| CPU | {m.get('cores')} cores, {m.get('cpu')}, {m.get('memory_gb')} GB RAM |",
        f"| Load average (1 min) | {meta['load_start'][0]:.2f} at the start, "
        f"{meta['load_end'][0]:.2f} at the end (other jobs share this machine) |",
        f"| OS | {m.get('platform')} |",
        f"| Python | {m.get('python')} |",
        f"| Celery / kombu | {m.get('celery')} / {m.get('kombu')} |",
        f"| SQLAlchemy / psycopg / PyMySQL | {m.get('sqlalchemy')} / {m.get('psycopg')} / "
        f"{m.get('pymysql', '?')} |",
        f"| PostgreSQL / MariaDB | {m.get('postgresql', '?')} / {m.get('mariadb', '?')} |",
        f"| RabbitMQ / Redis | {m.get('rabbitmq', '?')} / {m.get('redis', '?')} |",
        f"| celery-redbeat | {m.get('celery-redbeat', '?')} |",
        "",
        "## Summary",
        "",
        "Targets are those of DESIGN §5. Baselines are plain Celery (`-P prefork`, same broker, "
        "same `-c`) and RedBeat.",
        "",
        table(summary_rows(results), SUMMARY_HEADER),
    ]
    _section(lines, results, "throughput", "1. Throughput: `-P pulse` vs `-P prefork`",
             lambda d, ls: _md_throughput(d, ls, results, img))
    _section(lines, results, "profile", "1b. Where a pulse worker's time goes (py-spy)",
             lambda d, ls: _md_profile(d, ls, results))
    _section(lines, results, "sqlcost", "2. SQL cost per task and at idle",
             lambda d, ls: _md_sql(d, ls, img))
    _section(lines, results, "scale", "3. Store scale: renewals of many workers",
             lambda d, ls: _md_scale(d, ls, img))
    _section(lines, results, "recovery", "4. Recovery after SIGKILL",
             lambda d, ls: _md_recovery(d, ls, img))
    _section(lines, results, "failover", "5. Leader failover: pulse beat vs RedBeat",
             lambda d, ls: _md_failover(d, ls, img))
    _section(lines, results, "leaseloss", "6. Lease-loss reaction",
             lambda d, ls: _md_leaseloss(d, ls, img))
    _section(lines, results, "throughput", "7. Memory",
             lambda d, ls: _md_memory(d, ls, img))
    if "memory" in results["sections"]:
        _section(lines, results, "memory",
                 "7b. The parent's memory over a long run (issue 35)", _md_parent_memory)
    else:
        lines += ["", "## 7b. The parent's memory over a long run (issue 35)", "",
                  "_Not run in this invocation: it runs on its own (10-40 minutes), "
                  "`python -m benchmarks run --only memory`._"]
    _section(lines, results, "drivers", "8. MySQL/MariaDB drivers", _md_drivers)
    _section(lines, results, "permits", "9. Concurrency permits: a limited task kind vs an "
             "unlimited one", lambda d, ls: _md_permits(d, ls, img))
    _section(lines, results, "gateway", "10. Through the lease gateway (issue 18)",
             _md_gateway)
    _section(lines, results, "retention", "11. Retention at the highest task rate (issue 35)",
             retention.markdown)
    _section(lines, results, "wakeup", "12. A limited task's wake-up without LISTEN "
             "(PgBouncer, issue 36)", wakeup.markdown)
    _section(lines, results, "rates", "13. Cluster-wide rate limits (issue 39)", _md_rates)
    _section(lines, results, "checkpoints", "14. Checkpoints carried by the renewal (issue 40)",
             _md_checkpoints)
    lines += ["", "## How the runner measures", "",
              "- Every broker queue, PostgreSQL schema, MariaDB database and SQLite file is fresh "
              "per run and migrated first; every process the runner starts lives in its own process group "
              "and is killed (SIGKILL of the group) when its measurement ends, also on errors.",
              "- Workers run `celery -A benchmarks.apps worker -P <pool> -c N --without-mingle "
              "--without-gossip --without-heartbeat -l warning`; the app is configured by "
              "environment variables (`benchmarks/apps.py`).",
              "- Times are wall-clock times written by the tasks themselves (one `O_APPEND` "
              "write each) and by the runner; CPU is the on-CPU time of every thread, from "
              "`/proc/<pid>/task/*/schedstat`.",
              "- Raw results of this run: `benchmarks.json` next to this page.", ""]
    path = out_dir / "benchmarks.md"
    path.write_text("\n".join(lines))
    return path


def _md_throughput(tp: dict[str, Any], lines: list[str], results: dict[str, Any],
                   img: Path) -> None:
    rows = []
    for r in tp["summary"]:
        cpu = r["cpu_ms_per_task"]
        rows.append([tp["workloads"][r["workload"]], BROKER_LABEL[r["broker"]],
                     STORE_LABEL[r["variant"]], num(r["rate"]),
                     ", ".join(num(x) for x in r["rates"]),
                     "—" if r["variant"] == "prefork" else ratio(r["ratio"]),
                     f"{cpu['parent']:.2f} / {cpu['children']:.2f} / {store_cpu(cpu):.2f}"])
    lines += [f"N tasks (plus a final `stop` task) are published to a fresh queue, then one "
              f"worker with `-c {tp['concurrency']}` is started on it: rate = N / (start of "
              f"`stop` - `worker_ready`). Runs of prefork and pulse alternate; the ratio is the "
              f"median of per-repeat ratios. CPU columns: ms of CPU per task in the worker's "
              f"parent process, its pool children and the store server serving it: for "
              f"PostgreSQL the backends connected to the benchmark's database"
              + ("; for MariaDB the whole `mariadbd` process (a connection is a thread of it, "
                 "not a process of its own, so the benchmark's share cannot be told apart): "
                 "that server is shared, and whatever else it served during a run is counted "
                 "too" if any(r["variant"] == "pulse-mariadb" for r in tp["summary"]) else "")
              + ". SQLite runs inside the worker (its cost is in the worker's columns)."
              + _unmeasured(tp, "pulse-mariadb")
              + _results_method(tp)
              + (f" {tp['disturbed_attempts']} run(s) were disturbed from outside (the shared "
                 f"broker dropped the worker's connection) and measured again."
                 if tp.get("disturbed_attempts") else ""), "",
              table(rows, ["Workload", "Broker", "Pool / store", "tasks/s (median)", "runs",
                           "vs prefork", "CPU ms/task parent / children / store server"]),
              "", f"![throughput]({plot_throughput(tp, img)})", "",
              f"![cpu per task]({plot_cpu(tp, img)})", "", "**What this means.** "]
    _throughput_meaning(tp, lines, results)
    meaning = _results_meaning(tp)
    if meaning:
        lines += ["", meaning]


def _throughput_meaning(tp: dict[str, Any], lines: list[str], results: dict[str, Any]) -> None:
    pulse = [r for r in tp["summary"] if r["variant"] != "prefork" and r["ratio"] is not None]
    pulse = [r for r in pulse if r["variant"] not in PEERS + RESULTS]
    if not pulse:
        return
    worst = min(pulse, key=lambda r: r["ratio"])
    best = max(pulse, key=lambda r: r["ratio"])
    missed = [r for r in pulse if r["ratio"] < THROUGHPUT_TARGET]
    text = (f"pulse reaches {worst['ratio']:.2f}{X} to {best['ratio']:.2f}{X} of plain prefork "
            f"throughput in these runs. ")
    if not missed:
        text += f"Every configuration meets the 0.9{X} target."
        lines[-1] += text
        return
    noop = [r for r in pulse if r["workload"].startswith("noop") and "late" not in r["workload"]
            and r["variant"] == "pulse-postgres" and r["broker"] == "rabbitmq"]
    if noop:
        base = next(r for r in tp["summary"] if r["variant"] == "prefork"
                    and r["broker"] == noop[0]["broker"] and r["workload"] == noop[0]["workload"])
        pc, bc = noop[0]["cpu_ms_per_task"], base["cpu_ms_per_task"]
        store = store_cpu(pc)
        plain, ours = bc["parent"] + bc["children"], pc["parent"] + pc["children"] + store
        text += (f"On no-op tasks the gap is CPU: a no-op costs plain Celery {plain:.2f} ms of "
                 f"CPU in all, pulse {ours:.2f} ms ({pc['parent']:.2f} in the worker's parent, "
                 f"{pc['children']:.2f} in the pool, {store:.2f} in PostgreSQL), on "
                 f"{results['meta']['machine'].get('cores')} cores shared by the broker, the "
                 f"database and the worker. The floor for any design that writes the same "
                 f"rows at these batch sizes is prefork's CPU plus PostgreSQL's: "
                 f"{plain:.2f} / ({plain:.2f} + {store:.2f}) = "
                 f"{plain / (plain + store):.2f}{X} of prefork; pulse is at "
                 f"{noop[0]['ratio']:.2f}{X}, the rest being Python in the worker's parent. ")
    sleep = [r for r in pulse if r["workload"].startswith("sleep")]
    if sleep:
        text += ("Tasks that do some work (10 ms each) are at "
                 + ", ".join(f"{ratio(r['ratio'])} ({tp['workloads'][r['workload']]}, "
                             f"{BROKER_LABEL[r['broker']]}, "
                             f"{STORE_LABEL[r['variant']].split(' · ')[1]})" for r in sleep)
                 + ": their starts are made ahead of the pool, so no process waits for the "
                 "store. ")
    peers = [r for r in tp["summary"] if r["variant"] in PEERS and r["ratio"] is not None]
    if peers:
        text += ("Peers that keep their state in PostgreSQL too, measured in the same "
                 "repeats: " + ", ".join(
                     f"{STORE_LABEL[r['variant']]} {ratio(r['ratio'])} of prefork "
                     f"({tp['workloads'][r['workload']]}, {num(r['rate'])} tasks/s, CPU "
                     f"{sum(r['cpu_ms_per_task'].values()):.2f} ms per task in all)"
                     for r in peers) + ". ")
    for variant in PULSE_STORES:
        small = next((r for r in tp["summary"] if r["variant"] == variant
                      and r["workload"] == "noop-2000" and r["broker"] == "rabbitmq"), None)
        big = next((r for r in tp["summary"] if r["variant"] == variant
                    and r["workload"] == "noop-20000" and r["broker"] == "rabbitmq"), None)
        if small and big and big["rate"] < 0.8 * small["rate"]:
            text += (f"With {STORE_LABEL[variant].split(' · ')[1]} the rate also drops as the "
                     f"claims table grows: {num(small['rate'])} tasks/s over 2,000 tasks, "
                     f"{num(big['rate'])} over 20,000, with the store's CPU per task going from "
                     f"{store_cpu(small['cpu_ms_per_task']):.2f} to "
                     f"{store_cpu(big['cpu_ms_per_task']):.2f} ms")
            sq = results["sections"].get("sqlcost")
            if variant == "pulse-postgres" and _ok(sq) and sq.get("claims_updates"):
                text += (f" (every claim row is updated twice after its insert, and "
                         f"{100 * sq['claims_hot_updates'] / sq['claims_updates']:.0f}% of "
                         f"those updates were HOT in section 2: each one changes an indexed "
                         f"column — lease_until, finished_at — so each adds entries to the "
                         f"indexes and leaves dead tuples for vacuum)")
            text += ". "
    prof = results["sections"].get("profile")
    if _ok(prof) and prof.get("consumer_loop"):
        text += ("Section 1b profiles a pulse worker under this load to show which part of it "
                 "limits the rate, and what would close the gap.")
    lines[-1] += text


def _results_method(tp: dict[str, Any]) -> str:
    """The sentences on the result-backend runs (issue 17), if there were any."""
    rows = [r for r in tp["summary"] if r["variant"] in RESULTS]
    if not rows:
        return ""
    where = list(dict.fromkeys(f"{tp['workloads'][r['workload']]} ({BROKER_LABEL[r['broker']]})"
                               for r in rows))
    checked = sum(r.get("results_checked", 0) for r in tp["summary"])
    sqla = any(r["variant"] == "prefork-sqla" for r in tp["summary"])
    return (f" Result backends (issue 17), on {'; '.join(where)}: every task stores its "
            f"result, in Redis (a database of its own, emptied before each run; the store "
            f"column adds the whole `redis-server` process, shared like MariaDB's) or with "
            f"`result_backend = \"pulse://\"` in the run's fresh PostgreSQL store, where the "
            f"worker's parent writes each result in the statement that completes the task. "
            f"After each run the runner waited for a `SUCCESS` of every task published in its "
            f"backend ({checked:,} results checked"
            + (", prefork + SQLAlchemy's included" if sqla else "") + "); a missing one "
            "fails the run.")


def _delta(value: float) -> str:
    """A signed difference in ms, with no ``-0.00``."""
    return f"{0.0 if abs(value) < 0.005 else value:+.2f}"


def _results_meaning(tp: dict[str, Any]) -> str:
    """The paragraph on the result backends (issue 17), chosen by their numbers."""
    labels = tp["workloads"]
    noop = "noop-2000" if "noop-2000" in labels else "noop-500"
    mine = _find(tp, "pulse-results", noop)
    plain = _find(tp, "pulse-postgres", noop)
    if mine is None or plain is None:
        return ""
    sqla = _find(tp, "prefork-sqla", noop)
    vs_plain = versus(mine, plain)
    text = (f"**What this means for results.** With every result stored in the pulse store "
            f"(`pulse://`), a pulse worker runs {num(mine['rate'])} no-op tasks/s "
            f"({labels[noop]}, RabbitMQ): {ratio(vs_plain)} pulse without results (target "
            f"≥ {RESULTS_VS_PLAIN_TARGET}{X}, {verdict(vs_plain >= RESULTS_VS_PLAIN_TARGET)})")
    if sqla:
        vs_sqla = versus(mine, sqla)
        text += (f" and {ratio(vs_sqla)} prefork with Celery's SQLAlchemy backend on the same "
                 f"PostgreSQL ({num(sqla['rate'])} tasks/s; target ≥ "
                 f"{RESULTS_VS_SQLA_TARGET}{X}, {verdict(vs_sqla >= RESULTS_VS_SQLA_TARGET)})")
    m, p = mine["cpu_ms_per_task"], plain["cpu_ms_per_task"]
    text += (f". Per task, storing the result costs pulse {_delta(m['parent'] - p['parent'])} "
             f"ms of CPU in the worker's parent ({m['parent']:.2f} vs {p['parent']:.2f}), "
             f"{_delta(m['children'] - p['children'])} ms in the pool children (they write "
             f"nothing, but still build and encode the result and hand it to the parent) and "
             f"{_delta(store_cpu(m) - store_cpu(p))} ms in PostgreSQL: the result rides in the "
             f"statement that completes the task. ")
    if sqla:
        s_ = sqla["cpu_ms_per_task"]
        text += (f"Prefork with the SQLAlchemy backend spends {s_['children']:.2f} ms per task "
                 f"in its children and {store_cpu(s_):.2f} ms in PostgreSQL: a session, a "
                 f"read and a transaction of its own for every result. ")
    others = []
    prefork_redis = _find(tp, "prefork-redis", noop)
    if prefork_redis and prefork_redis["ratio"] is not None:
        others.append(f"prefork {num(prefork_redis['rate'])} tasks/s "
                      f"({ratio(prefork_redis['ratio'])} of prefork without results)")
    pulse_redis = _find(tp, "pulse-redis", noop)
    if pulse_redis:
        others.append(f"pulse {num(pulse_redis['rate'])} tasks/s "
                      f"({ratio(versus(pulse_redis, plain))} of pulse without results; "
                      f"pulse with `pulse://` runs {ratio(versus(mine, pulse_redis))} as fast)")
    if others:
        text += ("With Redis for results, written by the pool children as in plain Celery: "
                 + ", ".join(others) + ". ")
    for key in (k for k in labels if k.startswith("sleep") and "late" not in k):
        work = [r for r in (_find(tp, v, key) for v in ("pulse-results", "pulse-redis",
                                                        "prefork-redis", "prefork-sqla"))
                if r is not None and r["ratio"] is not None]
        if not work or work[0]["variant"] != "pulse-results":
            continue
        base = _find(tp, "pulse-postgres", key)
        text += (f"On {labels[key]}, of prefork without results: " + ", ".join(
            f"{STORE_LABEL[r['variant']]} {ratio(r['ratio'])}" for r in work)
            + (f" (pulse + `pulse://` is {ratio(versus(work[0], base))} pulse without "
               f"results)" if base else "") + ". ")
    return text.rstrip()


def _unmeasured(tp: dict[str, Any], variant: str) -> str:
    """A sentence naming the workloads ``variant`` was not run on (if it ran at all)."""
    summary = tp["summary"]
    if not any(r["variant"] == variant for r in summary):
        return ""
    ran = {(r["broker"], r["workload"]) for r in summary if r["variant"] == variant}
    missing = list(dict.fromkeys(tp["workloads"][r["workload"]] for r in summary
                                 if r["variant"] == "prefork"
                                 and (r["broker"], r["workload"]) not in ran))
    if not missing:
        return ""
    return (f" {STORE_LABEL[variant]} was not run on {'; '.join(missing)} (the full run's "
            f"time budget).")


def _exchange_share(loop: dict[str, float]) -> float:
    return sum(share for name, share in loop.items() if name.startswith("store exchange"))


def bottleneck(prof: dict[str, Any], sq: dict[str, Any] | None) -> str:
    """Which part of the worker limits the rate, from the profile."""
    loop = prof["consumer_loop"]
    loop_busy = 100 - loop.get("idle (waiting in epoll)", 0.0)
    waiting = prof["children"].get("waiting for a job", 0.0)
    commit = prof.get("commit_thread", {})
    commit_busy = 100 - commit.get("idle", 100.0)
    text = (f"The py-spy profile shows where it goes: the pool children wait for work "
            f"{waiting:.0f}% of the time; the consumer loop is busy {loop_busy:.0f}% of the "
            f"time (of which the store exchanges it runs itself: "
            f"{_exchange_share(loop):.0f}%) and the commit thread (what of the hot path "
            f"would block the loop) {commit_busy:.0f}%. ")
    if _ok(sq) and sq.get("ops_per_exchange"):  # type: ignore[union-attr]
        text += (f"Under load an exchange carried {sq['ops_per_exchange']:.1f} operations "  # type: ignore[index]
                 f"(reservations, starts and completions) in one round trip. ")
    busiest = max(loop.items(), key=lambda kv: kv[1] if "idle" not in kv[0] else -1)
    if loop_busy >= 60:
        text += (f"The consumer loop is the busiest part: the largest share of it is "
                 f"\"{busiest[0]}\" ({busiest[1]:.0f}%). Everything else the loop does per "
                 f"task is Celery's own (AMQP frames, the strategy, billiard's pipes), which "
                 f"prefork pays too.")
    return text


#: The profile's store kinds, as the report names them.
STORE_NAMES = {"postgres": "PostgreSQL", "sqlite": "SQLite", "mariadb": "MariaDB"}


def _md_profile(pr: dict[str, Any], lines: list[str], results: dict[str, Any]) -> None:
    lines += [f"`py-spy record --subprocesses --idle` sampled a `-P pulse -c 2` worker "
              f"(RabbitMQ, {STORE_NAMES.get(pr.get('store', 'postgres'), pr.get('store'))}) "
              f"for {pr['seconds']} s at {pr['rate_hz']} Hz while it "
              f"worked through a long queue of no-op tasks. Shares of samples:", ""]
    for title, key in (("Consumer loop (parent, main thread)", "consumer_loop"),
                       ("Pool children (all)", "children"),
                       ("Commit thread (what of the hot path would block the loop)", "commit_thread")):
        rows = [[k, f"{v:.1f}%"] for k, v in pr.get(key, {}).items()]
        lines += [f"**{title}**", "", table(rows, ["Where", "Share"]), ""]
    lines.append("**What this means.** " + bottleneck(pr, results["sections"].get("sqlcost")))


def _md_sql(sq: dict[str, Any], lines: list[str], img: Path) -> None:
    stores = sql_stores(sq)
    lines += [f"Counted by the server: a private server of each kind (durable, as in "
              f"production) is the store of one `-P pulse -c 2` worker on RabbitMQ, and "
              f"nothing else's statements are counted (settings {sq['conf']}). Under load: "
              f"{sq['n']:,} no-op tasks published to the running worker, counted until every "
              f"claim was final. Idle: {sq['idle_seconds']:.0f} s with nothing to do. Held: "
              f"the worker holds {sq['held_leases']} leases of long tasks for "
              f"{sq['held_seconds']:.0f} s (renewals)."
              + ("" if len(stores) > 1 else " Only PostgreSQL was measured in this run."), "",
              f"![sql cost]({plot_sql(sq, img)})", ""]
    for store, data in stores:
        lines += [f"### {SQL_STORES[store]}", ""]
        (_md_sql_postgres if store == "postgres" else _md_sql_mariadb)(data, lines)
        lines.append("")


def _sql_tables(sq: dict[str, Any], lines: list[str]) -> None:
    rows = [[k, f"{sq['per_task'][k]:.3f}", f"{sq['idle_per_second'][k]:.2f}"]
            for k in sq["per_task"] if sq["per_task"][k] or sq["idle_per_second"][k]]
    rpc = sq["rows_per_call"]
    lines += [table(rows, ["Kind", "Statements per task (load)", "Statements per second (idle)"]),
              "",
              f"Rows per statement under load: reserve {num(rpc['reserve'], 2)}, start "
              f"{num(rpc['start'], 2)}, complete {num(rpc['complete'], 2)}. With "
              f"{sq['held_leases']} leases held, renewal ran "
              f"{sq['renew_calls_per_second'] * sq['renew_interval']:.2f} statements per "
              f"{sq['renew_interval']:g} s interval, {num(sq['renew_rows_per_call'], 0)} leases "
              f"each."
              + (f" Row updates of `pulse_claims` under load: {sq['claims_updates']:,}, of which "
                 f"{sq['claims_hot_updates']:,} HOT (heap-only, no index maintenance)."
                 if sq.get("claims_updates") is not None else ""),
              "", "Most frequent statements at idle:", "",
              table([[r["kind"], f"{r['per_second']:.2f}", f"`{r['query'][:110]}`"]
                     for r in sq["top_idle_statements"][:8]], ["Kind", "per second", "Statement"]),
              ""]


def _md_sql_postgres(sq: dict[str, Any], lines: list[str]) -> None:
    rpc = sq["rows_per_call"]
    lines += [f"`pg_stat_statements` (utility statements tracked, so BEGIN/COMMIT/ROLLBACK "
              f"count); round trips are those statements, except the hot path's, which the "
              f"worker sends pipelined, counted by the worker itself (`exchanges` in its "
              f"stats). The load took {sq['load_seconds']:.1f} s.", ""]
    _sql_tables(sq, lines)
    exchanges = sq.get("exchanges_per_task")
    text = (f"**What this means.** A task costs {sq['per_task_lifecycle']:.2f} hot-path "
            f"statements (reserve + start + complete, amortised over batches) and "
            f"{sq['per_task_total']:.2f} round trips in all, so the ≤ 1 statement target is "
            f"{'met' if sq['per_task_lifecycle'] <= 1 else '**missed**'} and the ≤ 1 round "
            f"trip target is {'met' if sq['per_task_total'] <= 1 else '**missed**'}. ")
    if exchanges is not None:
        text += (f"The three kinds travel together: {exchanges:.3f} exchanges per task, "
                 f"{num(sq.get('ops_per_exchange'), 1)} operations each, one pipelined round "
                 f"trip and one transaction per exchange; reservations carried "
                 f"{num(rpc['reserve'], 1)} rows per statement, starts "
                 f"{num(rpc.get('start'), 1)} and completions {num(rpc['complete'], 1)}. ")
    idle = sq["idle_per_second"]
    text += (f"Renewal is one statement per interval whatever the number of leases (O(1) per "
             f"worker). An idle worker sends {sq['idle_total_per_second']:.1f} statements "
             f"per second: {idle['begin/commit']:.1f} of them BEGIN/COMMIT/ROLLBACK (the "
             f"recover scan's transaction; reads run in autocommit), "
             f"{idle['beat'] + idle['other']:.1f} the beat's once-a-second "
             f"reads of the schedule and the store clock (this worker is the beat leader; "
             f"only the leader ticks), {idle['recover']:.1f} recover scans, "
             f"{idle['leader'] + idle['registry']:.2f} leader and registry renewals.")
    lines.append(text)


def _md_sql_mariadb(sq: dict[str, Any], lines: list[str]) -> None:
    lines += [f"The Performance Schema counts every statement by its digest "
              f"(`events_statements_summary_by_digest`, COMMIT and ROLLBACK included); only "
              f"those run in the store's database count, which nobody but the worker uses "
              f"(the runner's own reads connect to no database). A worker's usual exchange "
              f"(completions, reservations of new task ids, starts needing no permit) is one "
              f"multi-statement packet with its COMMIT (`store/sql/mysql_packet.py`); any "
              f"other is one transaction sent a statement at a time. Round trips are the "
              f"statements, less those the packets carried, plus the packets (the worker "
              f"counts both: `packets`, `packet_statements` in its stats), plus any request "
              f"that is not a statement (a ping), counted for the worker's user. The Performance "
              f"Schema files a packet's statements under digest texts that all begin with the "
              f"packet's first statement, so the kinds below put a packet's statements under "
              f"its first one's (usually complete); the totals are exact. The load took "
              f"{sq['load_seconds']:.1f} s.", ""]
    _sql_tables(sq, lines)
    per_task, idle = sq["per_task"], sq["idle_per_second"]
    exchanges = sq.get("exchanges_per_task")
    rollbacks = sq.get("rollbacks_per_task")
    text = (f"**What this means.** A task costs {sq['per_task_lifecycle']:.2f} hot-path "
            f"statements (reserve + start + complete, amortised over batches: DESIGN's ≤ 3 "
            f"is {'met' if sq['per_task_lifecycle'] <= 3 else '**missed**'}) plus "
            f"{per_task['begin/commit']:.2f} COMMIT/ROLLBACK sent on their own: "
            f"{sq['statements_per_task_total']:.2f} statements per task in all, in "
            f"{sq['per_task_total']:.2f} round trips (issue 41's target ≤ 0.5 "
            f"{'met' if sq['per_task_total'] <= 0.5 else '**missed**'}). ")
    if exchanges is not None:
        text += (f"The group commit still batches: {exchanges:.3f} exchanges per task, "
                 f"{num(sq.get('ops_per_exchange'), 1)} operations each, one transaction "
                 f"per exchange. ")
    if rollbacks:
        commits = per_task["begin/commit"] - rollbacks
        text += (f"{rollbacks:.2f} round trips per task are ROLLBACKs, next to {commits:.2f} "
                 f"COMMITs: SQLAlchemy's pool resets every connection returned to it with a "
                 f"rollback, which PyMySQL sends to the server even after the transaction "
                 f"committed (psycopg skips it when no transaction is open); at idle they also "
                 f"end the transactions of reads ("
                 f"{sq.get('idle_rollbacks_per_second', 0.0):.1f} ROLLBACKs per second). ")
    text += (f"Renewal is one transaction per interval whatever the number of leases: its "
             f"statements each covered {num(sq['renew_rows_per_call'], 0)} of the "
             f"{sq['held_leases']} leases held. An idle worker sends "
             f"{sq['idle_total_per_second']:.1f} statements per second: "
             f"{idle['begin/commit']:.1f} of them COMMIT/ROLLBACK, "
             f"{idle['beat'] + idle['other']:.1f} the beat's reads of the schedule and the "
             f"store clock, {idle['recover']:.1f} recover scans, "
             f"{idle['leader'] + idle['registry']:.2f} leader and registry renewals.")
    lines.append(text)


def _md_scale(sc: dict[str, Any], lines: list[str], img: Path) -> None:
    rows = [[str(p["workers"]), f"{p['leases']:,}", f"{p['renew_p50_ms']:.1f}",
             f"{p['renew_p99_ms']:.1f}", f"{p['pg_cpu_percent']:.1f}%",
             f"{p['statements_per_second']:.0f}", f"{p['rows_per_second']:,.0f}",
             f"{p['failures']}", f"{p['lost']}"] for p in sc["points"]]
    lines += [f"Each simulated worker is the real `LeaseKeeper` on its own `SqlStore` "
              f"connection, holding {sc['leases_per_worker']} leases and renewing them in one "
              f"statement every {sc['interval']:g} s (lease TTL {sc['ttl']:g} s): "
              f"{sc['default_interval'] / sc['interval']:.0f}{X} the default rate (TTL 30 s, "
              f"renew every 10 s), so the store load here is that of "
              f"{sc['default_interval'] / sc['interval']:.0f}{X} as many workers at defaults. The "
              f"store is a private PostgreSQL with default durability (fsync on); its CPU "
              f"is read from /proc over {sc['duration']:g} s.", "",
              table(rows, ["Workers", "Leases", "p50 ms", "p99 ms", "PostgreSQL CPU",
                           "renewals/s", "rows/s", "failed", "lost"]),
              "", f"![store scale]({plot_scale(sc, img)})", ""]
    first, last = sc["points"][0], sc["points"][-1]
    lost = sum(p["lost"] + p["failures"] for p in sc["points"])
    lines.append(
        f"**What this means.** From {first['workers']} to {last['workers']} workers the renew "
        f"p99 goes from {first['renew_p99_ms']:.1f} ms to {last['renew_p99_ms']:.1f} ms and the "
        f"database's CPU from {first['pg_cpu_percent']:.1f}% to {last['pg_cpu_percent']:.1f}% "
        f"of one core, while renewing {last['rows_per_second']:,.0f} leases per second. "
        + ("No renewal failed and no lease was lost. " if lost == 0 else
           f"{lost} renewals failed or leases were lost: the store is saturated here. ")
        + f"Latency stays far below the lease TTL ({sc['ttl']:g} s), so the self-fence margin "
        f"is never at risk from the store's own speed at this scale.")


def _md_recovery(rc: dict[str, Any], lines: list[str], img: Path) -> None:
    rows = []
    for c in [*rc["cases"], *rc["stated"]]:
        rows.append(["pulse" if c["pool"] == "pulse" else "plain Celery",
                     BROKER_LABEL[c["broker"]], "yes" if c["acks_late"] else "no",
                     c["outcome"], "—" if c["seconds"] is None else
                     (f"{c['seconds']:,.0f} s (stated)" if c.get("stated") else s(c["seconds"])),
                     "—" if c.get("stated") else f"{c['prefetched_lost']} of {c['prefetched']}"])
    lines += [f"Worker A (`-c 1`) runs a 60 s task and has {rc['cases'][0]['prefetched']} "
              f"short tasks prefetched; worker B is ready; A's process group gets SIGKILL. "
              f"pulse settings: {rc['conf']} (target: lease_ttl + recover_interval + 1 s = "
              f"{rc['bound']:g} s).", "",
              table(rows, ["Pool", "Broker", "acks_late", "Outcome", "SIGKILL → outcome",
                           "Prefetched lost"]),
              "", f"![recovery]({plot_recovery(rc, img)})", ""]
    pulse = [c for c in rc["cases"] if c["pool"] == "pulse" and c["seconds"] is not None]
    worst = max((c["seconds"] for c in pulse), default=None)
    plain = [c for c in rc["cases"] if c["pool"] == "prefork"]
    text = "**What this means.** "
    if worst is not None:
        text += (f"pulse gets a killed worker's task going again (or into review) within "
                 f"{worst:.1f} s, inside its {rc['bound']:g} s bound, on every broker — it is "
                 f"the lease expiring by the store clock plus one recover scan. ")
    rabbit = next((c for c in plain if c["acks_late"] and c["seconds"] is not None), None)
    if rabbit:
        text += (f"Plain Celery on RabbitMQ is faster for `acks_late` tasks "
                 f"({rabbit['seconds']:.2f} s: the broker redelivers as soon as the dead "
                 f"connection closes), ")
    lost = next((c for c in plain if not c["acks_late"]), None)
    if lost:
        text += ("but a default (early-ack) task that was running is simply gone, " if
                 lost["seconds"] is None else "")
    text += (f"and on Redis plain Celery waits for `visibility_timeout` "
             f"({rc['stated'][0]['seconds']:,.0f} s by default) before anything runs again — "
             f"pulse's time does not depend on the broker. ")
    lost_total = sum(c["prefetched_lost"] for c in rc["cases"] if c["pool"] == "pulse")
    text += ("No prefetched message was lost." if lost_total == 0 else
             f"**{lost_total} prefetched messages were lost** (target 0).")
    text += (" (The worker is killed once its prefetch is reserved. On Redis a worker killed "
             "while kombu's `BRPOP` answer is in flight, before kombu records the message as "
             "unacknowledged, loses that message: see the FAQ, \"What does pulse change in "
             "the Redis transport's settings?\".)")
    lines.append(text)


def _md_failover(fo: dict[str, Any], lines: list[str], img: Path) -> None:
    rows = [[c["label"], c["event"], _takeover(c), s(c["max_gap_s"]),
             num(c["skipped_slots"]) if c["skipped_slots"] is not None else "—",
             str(c["duplicates"]), f"≤ {c['expected_s']:g} s"] for c in fo["cases"]]
    lines += [f"Two scheduler replicas on a {fo['period']:g} s schedule, broker = local Redis; "
              f"the runner reads every tick off the queue. Replica 1 leads; then it gets "
              f"SIGKILL (crash) or SIGTERM (planned handover). pulse replicas are "
              f"`celery pulse beat`, RedBeat replicas `celery beat -S redbeat.RedBeatScheduler`.",
              "", table(rows, ["Scheduler", "Event", "signal → next tick", "longest gap",
                               "slots skipped", "slots twice", "configured bound"]),
              "", f"![failover]({plot_failover(fo, img)})", ""]
    text = "**What this means.** "
    pulse_missed = [c for c in fo["cases"] if c["scenario"].startswith("pulse") and
                    (c["takeover_s"] is None or c["takeover_s"] > c["expected_s"])]
    text += ("Every pulse failover is inside its configured bound (crash: leader_ttl + "
             "interval + 1 s; handover: one interval). " if not pulse_missed else
             f"{len(pulse_missed)} pulse failovers exceeded their bound. ")
    tuned = {c["scenario"] + c["event"]: c for c in fo["cases"]}
    pc, rc_ = tuned.get("pulse-tunedcrash"), tuned.get("redbeat-tunedcrash")
    if pc and rc_ and pc["takeover_s"] and rc_["takeover_s"]:
        text += (f"Tuned to similar timeouts, the two are alike after a crash (pulse "
                 f"{pc['takeover_s']:.1f} s, RedBeat {rc_['takeover_s']:.1f} s). ")
    text += ("With their defaults they are not: pulse's leader lease is 15 s, RedBeat's lock "
             f"is 5 {X} beat_max_loop_interval = 1,500 s and a standby retries only every 300 s, "
             "so a crashed RedBeat leader stops the schedule for up to ~25 minutes. "
             "pulse fires the most recent missed slot once on takeover (`pulse_beat_catchup = "
             "latest`) and never fires a slot twice: each slot is a unique row with a "
             "deterministic task id.")
    lines.append(text)


def _md_leaseloss(ll: dict[str, Any], lines: list[str], img: Path) -> None:
    hard, out = ll["hard_stop"], ll["outage"]
    rows = [["store-side takeover → LeaseLost in the task",
             ", ".join(f"{x:.2f}" for x in ll["takeover_s"]) + " s", f"≤ {ll['bound_s']:g} s"],
            ["takeover → LeaseLost (task that ignores it)", s(hard["lease_lost_s"]),
             f"≤ {ll['bound_s']:g} s"],
            ["takeover → hard stop (child killed)", s(hard["hard_stop_s"]),
             f"≤ {ll['bound_s'] + ll['conf']['pulse_revoke_grace']:g} s"],
            ["store outage → LeaseLost (self-fence)", s(out["lease_lost_s"]),
             f"≤ {ll['self_fence_s']:g} s (ttl - margin)"],
            ["LeaseLost ahead of the store's lease_until", s(out["before_store_expiry_s"]), "> 0"]]
    lines += [f"pulse settings {ll['conf']} (renew interval {ll['renew_interval']:g} s). "
              f"Takeover: a raw SQL UPDATE grants the running task's claim to someone else "
              f"(epoch + 1), as Recover would; the task checks its lease every 10 ms and "
              f"records `LeaseLost` itself. Outage: the store is a private PostgreSQL that "
              f"is stopped (immediate mode) while the task runs.", "",
              table(rows, ["What", "Measured", "Bound"]), "",
              f"![lease loss]({plot_leaseloss(ll, img)})", ""]
    ok = ll["takeover_max_s"] <= ll["bound_s"]
    lines.append(
        f"**What this means.** A task learns it lost its lease within one renew interval "
        f"(median {ll['takeover_median_s']:.2f} s, max {ll['takeover_max_s']:.2f} s: the next "
        f"batched renewal notices, then SIGUSR2 raises `LeaseLost` inside the body) — "
        f"{'inside' if ok else '**outside**'} the renew_interval + 1 s target. A task that "
        f"ignores it is killed {hard['after_lease_lost_s']:.2f} s later (revoke_grace "
        f"{ll['conf']['pulse_revoke_grace']:g} s). When the store itself disappears, nothing "
        f"can be renewed and the worker fences on its own clock: `LeaseLost` came "
        f"{out['lease_lost_s']:.2f} s after the outage began, "
        f"{out['before_store_expiry_s']:.2f} s before the store could have granted the task "
        f"to anybody else.")


def _md_memory(tp: dict[str, Any], lines: list[str], img: Path) -> None:
    rows = []
    for v in VARIANTS:
        mine = [r for r in tp["summary"] if r["variant"] == v]
        if mine:
            rows.append([STORE_LABEL[v], f"{statistics.median(r['rss_mb'] for r in mine):.0f}",
                         f"{statistics.median(r['pss_mb'] for r in mine):.0f}"])
    lines += [f"Sum over the worker's process group (parent + {tp['concurrency']} children), "
              f"read from `/proc/<pid>/smaps_rollup` at the end of each throughput run. RSS "
              f"counts pages shared after fork once per process; PSS splits them.", "",
              table(rows, ["Worker", "RSS MB", "PSS MB"]), "",
              f"![memory]({plot_memory(tp, img)})", ""]
    base = next((float(r[2]) for r in rows if r[0] == "prefork"), None)
    pulse = next((float(r[2]) for r in rows if r[0] == STORE_LABEL["pulse-postgres"]), None)
    if base and pulse:
        lines.append(
            f"**What this means.** A pulse worker uses {pulse - base:+.0f} MB "
            f"({pulse / base:.2f}{X}) of the memory of a prefork worker at the same `-c`: "
            f"SQLAlchemy, the PostgreSQL driver and pulse's threads in the parent, and one "
            f"store connection per child.")


def _md_parent_memory(data: dict[str, Any], lines: list[str]) -> None:
    from benchmarks import memory

    memory.markdown(data, lines)


DRIVER_NAMES = {"pymysql": "PyMySQL", "mysqldb": "mysqlclient",
                "mariadbconnector": "MariaDB Connector/Python"}


def _md_drivers(dr: dict[str, Any], lines: list[str]) -> None:
    rows = dr["summary"]
    if not rows:
        lines.append("_No MySQL driver is installed._")
        return
    base = next((r for r in rows if r["driver"] == "pymysql"), rows[0])
    ms = functools.partial(num, digits=3)
    table_rows = [[f"{DRIVER_NAMES[r['driver']]} {dr['versions'][r['driver']]}",
                   ms(r["wall_ms_1"]), ms(r["cpu_ms_1"]), ms(r["wall_ms_16"]),
                   ms(r["cpu_ms_16"]), ratio(r["cpu_ms_1"] / base["cpu_ms_1"]),
                   f"{num(r['rate'])} ({ratio(r['ratio'])})", num(r["parent_cpu_ms"], 2)]
                  for r in rows]
    lines += [
        "Each installed driver on fresh MariaDB databases, in alternated repeats (medians). "
        "Hot path: rounds of `reserve` (granted `running`) then `complete` in one process, "
        "batches of 1 and of 16 tasks, wall time and the client's CPU per task. Worker: "
        f"{dr['workload']} tasks on `-P pulse -c 2` (RabbitMQ), ratio against plain prefork "
        "in the same repeat.", "",
        table(table_rows, ["Driver", "ms/task, batch 1", "CPU ms/task, batch 1",
                           "ms/task, batch 16", "CPU ms/task, batch 16",
                           "client CPU vs PyMySQL (batch 1)", "worker tasks/s (vs prefork)",
                           "parent CPU ms/task"]), ""]
    if dr["missing"]:
        lines += ["Not installed here, so not measured: "
                  + ", ".join(DRIVER_NAMES[d] for d in dr["missing"]) + ".", ""]
    lean = min(rows, key=lambda r: r["cpu_ms_1"])
    quick = max(rows, key=lambda r: r["rate"])
    gain = quick["rate"] / base["rate"]
    lines.append(
        f"**What this means.** The least client CPU per single-task batch is "
        f"{DRIVER_NAMES[lean['driver']]}'s, {ratio(lean['cpu_ms_1'] / base['cpu_ms_1'])} of "
        f"PyMySQL's; on a worker, the fastest driver ({DRIVER_NAMES[quick['driver']]}) runs "
        f"{ratio(gain)} PyMySQL's tasks per second. A grant's cost is mostly its round trips "
        f"(a locking read, the writes, a read-back and COMMIT per batch) and SQLAlchemy's "
        f"work per statement, which are the same whichever driver carries them. "
        + ("So PyMySQL, pure Python and installable without a compiler or client headers, "
           "stays the default (`mysql://`); `mysql+mysqldb://` and "
           "`mariadb+mariadbconnector://` are accepted where those drivers are installed "
           "already." if gain < 1.10 else
           f"A gain of {ratio(gain)} is worth a compiler and client headers: prefer "
           f"{DRIVER_NAMES[quick['driver']]} where it installs; PyMySQL stays the default "
           f"(`mysql://`) because it installs everywhere."))


def _md_permits(pm: dict[str, Any], lines: list[str], img: Path) -> None:
    c = pm["concurrency"]
    rows = []
    for r in pm["summary"]:
        cpu = r["cpu_ms_per_task"]
        rows.append([pm["workloads"][r["workload"]], permit_label(r["variant"]), num(r["rate"]),
                     ", ".join(num(x) for x in r["rates"]),
                     ratio(r["ratio"]) if r["variant"] != "unlimited" else f"1.00{X} (baseline)",
                     f"{r['most_at_once']}" + (f" of {r['limit']:,}" if r["limit"] else ""),
                     "—" if r.get("handover_ms") is None else
                     f"{r['handover_ms'][0]:.1f} / {r['handover_ms'][1]:.1f}",
                     f"{r['held_left']} / {r['waiting_left']}", str(r["hold_rows_left"]),
                     f"{cpu['parent']:.2f} / {cpu['children']:.2f} / {store_cpu(cpu):.2f}"])
    lines += [
        f"N tasks of one kind are published to a fresh queue, then one `-P pulse -c {c}` "
        f"worker (RabbitMQ, a fresh PostgreSQL store) is started on it, as in section 1. "
        f"The kind's limit is declared with `pulse_concurrency_limits` (the task option "
        f"`pulse_concurrency` by another name), so every row runs the very same task. Each "
        f"body writes when it began and ended (one `write` on a descriptor it keeps open), "
        f"whatever the row: rate = N / (last body's end - `worker_ready`); \"most at once\" "
        f"is the most bodies whose spans overlap. A final `stop` task would not do here: "
        f"unlimited, it can start while limited tasks still wait in the worker. The four "
        f"rows run one after another in each repeat ({pm['repeats']}); the ratio is the "
        f"median of per-repeat ratios to the unlimited kind. After the last body the runner "
        f"waits for every claim to be final, then reads the store: permits still held and "
        f"tasks still waiting for one (both must be 0), and rows left in "
        f"`pulse_permit_holds` (past attempts' rows hold nothing; the key's next start or "
        f"retention drops them)."
        + (f" {pm['disturbed_attempts']} run(s) were disturbed from outside and measured "
           f"again." if pm.get("disturbed_attempts") else ""),
        "",
        "- **unlimited**: no limit declared anywhere: the baseline.",
        "- **limit 1,000**: the same task under a limit it never reaches: the pure cost of "
        "taking a permit at each start and giving it back at each completion.",
        f"- **limit {c}**: the limit equals the worker's concurrency: it binds whenever "
        f"every pool process is busy, which the pool would enforce anyway.",
        f"- **limit 1**: one at a time across the cluster (hand-over: from one body's end "
        f"to the next one's start), so {c - 1} of the {c} processes "
        f"idle: about {1 / c:.1f}{X} on timed tasks at best.",
        "",
        table(rows, ["Workload", "Task kind", "tasks/s (median)", "runs", "vs unlimited",
                     "most at once", "hand-over ms (median / p95)", "held / waiting left",
                     "hold rows left",
                     "CPU ms/task parent / children / store server"]),
        "", f"![permits]({plot_permits(pm, img)})", ""]
    lines.append("**What this means.** " + _permits_meaning(pm))


def _permits_meaning(pm: dict[str, Any]) -> str:
    """The paragraph under the permits table, chosen by its numbers."""
    c = pm["concurrency"]
    labels = pm["workloads"]
    parts = []
    for workload in labels:
        base = _permit_row(pm, workload, "unlimited")
        free = _permit_row(pm, workload, "limit-1000")
        if base is None or free is None or free["ratio"] is None:
            continue
        text = (f"On {labels[workload]}, a limit that never binds runs "
                f"{ratio(free['ratio'])} the unlimited kind's rate ({num(free['rate'])} vs "
                f"{num(base['rate'])} tasks/s)")
        if workload.startswith("sleep"):
            text += (f": each task keeps a pool process {1000 * c / free['rate']:.1f} ms "
                     f"instead of {1000 * c / base['rate']:.1f} ms")
        else:
            mine, theirs = free["cpu_ms_per_task"], base["cpu_ms_per_task"]
            text += (f"; per task the worker's parent spends {mine['parent']:.2f} ms of CPU "
                     f"instead of {theirs['parent']:.2f} and PostgreSQL "
                     f"{store_cpu(mine):.2f} ms instead of {store_cpu(theirs):.2f}")
        parts.append(text + ". ")
    text = "".join(parts)
    if parts:
        text += ("A limited task's start locks the key's row and counts its holders. On "
                 "PostgreSQL it rides on the worker's exchange, one transaction in two round "
                 "trips on the event loop (the key locked and counted with the exchange's "
                 "statements, the start with the COMMIT), and a new delivery's start is "
                 "folded into that transaction with its reservation when a process is free "
                 "for it or it would go ahead of the pool (the claim reserved, the key "
                 "counted, then started): a limited start costs the exchange one more round "
                 "trip and a second row update of the claim, where an unlimited task is "
                 "reserved running in one statement, but no exchange of its own. Otherwise "
                 "it is made ahead of the pool while earlier jobs run (per key, one in "
                 "flight at first, twice as many after each that got its permit); under a "
                 "limit that binds most tasks ask once their process is free, and that "
                 "process waits for the answer. ")
    for workload in labels:
        one = _permit_row(pm, workload, "limit-1")
        if one is None or one["ratio"] is None or not workload.startswith("sleep"):
            continue
        text += (f"Limit 1 on {labels[workload]} runs {ratio(one['ratio'])} the unlimited "
                 f"rate (one process at a time: {1 / c:.1f}{X} at best)")
        text += ". "
    handovers = [(labels[r["workload"]], *r["handover_ms"]) for r in pm["summary"]
                 if r["variant"] == "limit-1" and r.get("handover_ms") is not None]
    if handovers:
        text += ("Under limit 1, one body's end and the next one's start are "
                 + " and ".join(f"{median:.1f} ms apart on {label} (median; 95th percentile "
                                f"{p95:.1f} ms)" for label, median, p95 in handovers)
                 + ": the completion gives the permit back, then the next waiting task asks "
                 "for it and is handed to a process. ")
    over = _permit_overrun(pm)
    left = [r for r in pm["summary"] if r["held_left"] or r["waiting_left"] or r["live_left"]]
    text += ("No run had more bodies at once than its limit" if not over else
             "**More bodies ran at once than the limit allows in "
             + ", ".join(f"{labels[r['workload']]}, {permit_label(r['variant'])} "
                         f"({r['most_at_once']})" for r in over) + "**")
    text += (", and no permit was left held nor any task left waiting." if not left else
             "; **permits were left held or tasks waiting after "
             + ", ".join(f"{labels[r['workload']]}, {permit_label(r['variant'])} "
                         f"({r['held_left']} held, {r['waiting_left']} waiting, "
                         f"{r['live_left']} claims live)" for r in left) + "**.")
    return text


def _md_checkpoints(data: dict[str, Any], lines: list[str]) -> None:
    from benchmarks import checkpoints as section

    section.markdown(data, lines)


def _md_rates(rt: dict[str, Any], lines: list[str]) -> None:
    from benchmarks import rates as section

    lines += [(section.__doc__ or "").split("\n\n", 1)[1].strip(), "",
              "| Workload | variant | tasks/s (median) | vs unlimited | start delay past the "
              "window p50 / p99 | CPU ms per task: parent / children / store |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in rt["summary"]:
        cpu = r["cpu_ms_per_task"]
        variant = (f"rate {r['limit_per_s']}/s (binds)" if r["variant"] == "rate-binds"
                   else {"unlimited": "unlimited", "rate-never-binds":
                         f"rate {rt['never']} (never binds)", "rate-hour-never-binds":
                         f"rate {rt.get('never_hour')} (never binds)"}[r["variant"]])
        delay = ("—" if r["delay_ms"] is None
                 else f"{r['delay_ms'][0]:.1f} / {r['delay_ms'][1]:.1f} ms")
        lines.append(f"| {rt['workloads'][r['workload']]} | {variant} | {num(r['rate'])} | "
                     f"{ratio(r['ratio'])} | {delay} | {cpu['parent']:.2f} / "
                     f"{cpu['children']:.2f} / {store_cpu(cpu):.2f} |")


def _md_gateway(gw: dict[str, Any], lines: list[str]) -> None:
    from benchmarks import gateway as section

    lines += [(section.__doc__ or "").split("\n\n", 1)[1].strip(), "",
              "| Workload | direct (tasks/s) | through the gateway (tasks/s) | gateway / direct "
              "| two remote workers (tasks/s) | two / one | two workers, two gateways "
              "(tasks/s) | two gateways / one |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in gw["summary"]:
        # (reports from before issue 37 have no second worker, nor a second gateway)
        two = (f"{num(row['two'])} | {ratio(row['two_ratio'])}" if "two" in row
               else "— | —")
        gateways = (f"{num(row['two_gateways'])} | {ratio(row['two_gateways_ratio'])}"
                    if "two_gateways" in row else "— | —")
        lines.append(f"| {row['label']} | {num(row['direct'])} | {num(row['gateway'])} | "
                     f"{ratio(row['ratio'])} | {two} | {gateways} |")
    if all("cpu_ms" in row for row in gw["summary"]):  # measured since issue 37
        lines += ["", "CPU per task (milliseconds, every thread of the processes, between "
                  "the workers' ready and the last task; medians):", "",
                  "| Workload | direct worker | remote worker | its gateway | two remote "
                  "workers' gateway | two gateways, together |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in gw["summary"]:
            cpu = row["cpu_ms"]
            lines.append(f"| {row['label']} | {cpu['direct']['worker']:.2f} | "
                         f"{cpu['gateway']['worker']:.2f} | {cpu['gateway']['gateway']:.2f} | "
                         f"{cpu['gateway2']['gateway']:.2f} | "
                         f"{cpu['gateways2']['gateway']:.2f} |")
    if all("deep" in row for row in gw["summary"]):  # measured since stop 53
        lines += ["", "One remote worker with a deeper prefetch (prefetch multiplier 16, "
                  "against Celery's 4 above):", "",
                  "| Workload | multiplier 16 (tasks/s) | / direct | CPU per task: remote "
                  "worker | its gateway |", "| --- | --- | --- | --- | --- |"]
        for row in gw["summary"]:
            cpu = row["cpu_ms"]["gateway32"]
            lines.append(f"| {row['label']} | {num(row['deep'])} | "
                         f"{ratio(row['deep_ratio'])} | {cpu['worker']:.2f} | "
                         f"{cpu['gateway']:.2f} |")
    from benchmarks import gateway_cycle

    gateway_cycle.markdown(gw["summary"], lines, gw.get("concurrency", 2))
    renew = gw["renew"]
    lines += ["", f"Renewal round trip, {renew['clients']} workers renewing once every "
              f"{renew['every_s']:g} s for {renew['seconds']:g} s:", "",
              "| Path | renewals | p50 | p99 |", "| --- | --- | --- | --- |"]
    for key, label in (("direct", "direct to the store (one statement)"),
                       ("gateway", "through the gateway (TLS, one frame each way)")):
        r = renew[key]
        lines.append(f"| {label} | {r['count']} | {r['p50_ms']:.1f} ms | "
                     f"{r['p99_ms']:.1f} ms |")
    if gw.get("storm"):  # reports from before issue 37 have none
        from benchmarks import gateway_storm

        gateway_storm.markdown(gw["storm"], lines)
