"""What the ``celery pulse`` commands print for people: tables, hints, states.

Kept apart from the command modules of :mod:`celery_pulse.cli` (which talk to the
store) so the commands stay short. Tables size every column from the data (styled cells
measured without their colour codes, which a pipe strips), times are ISO 8601, and every
hint is a command that can be pasted as is: it names the app the way the user gave it
(``-A``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import click

from celery_pulse.store.records import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    REVOKED,
    RUNNING,
    SUCCEEDED,
)
from celery_pulse.timefmt import iso

#: Every claim state ``pulse claims --state`` accepts, in lifecycle order.
CLAIM_STATES = (RESERVED, RUNNING, OPEN, SUCCEEDED, FAILED, NEEDS_REVIEW, REVOKED)
DEFAULT_STATES = (RESERVED, RUNNING)


def app_argument(ctx: click.Context) -> str:
    """The ``-A`` value as the user gave it (so a hint can be pasted), else the app's name."""
    given = ctx.find_root().params.get("app")
    if isinstance(given, str) and given:
        return given
    app = ctx.obj.app if ctx.obj is not None else None
    return str(getattr(app, "main", None) or "proj")


def parse_states(_ctx: click.Context | None, _param: Any, values: Sequence[str]) -> list[str]:
    """``--state`` values (repeated and/or comma lists), each one a known claim state."""
    states: list[str] = []
    for value in values:
        states += [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in states if s not in CLAIM_STATES]
    if unknown:
        raise click.BadParameter(
            f"unknown state{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid states: {', '.join(CLAIM_STATES)} (comma-separate several)")
    return list(dict.fromkeys(states)) or list(DEFAULT_STATES)


def seconds(value: float) -> str:
    """A signed duration as the tables show it (a lease past its end is negative)."""
    return f"{value:+.1f}s"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *,
          right: Iterable[int] = ()) -> list[str]:
    """Lines of a table whose columns fit their widest cell (``right``: right-aligned)."""
    body = [list(r) for r in rows]
    widths = [max([len(h)] + [len(click.unstyle(r[i])) for r in body])
              for i, h in enumerate(headers)]
    flush_right = set(right)

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            pad = " " * (widths[i] - len(click.unstyle(cell)))
            out.append(pad + cell if i in flush_right else cell + pad)
        return "  ".join(out).rstrip()
    return [line(headers)] + [line(r) for r in body]


#: Labels shown in the workers table: a direct worker's, then a gateway worker's.
SHOWN_LABELS = ("pool", "concurrency", "pid", "queues", "gateway", "credential", "queue",
                "capacity")


def workers_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The workers table (``pulse workers``, and the body of ``pulse status``)."""
    if not rows:
        return ["no workers registered"]
    cells = []
    for r in rows:
        alive = click.style("yes", fg="green") if r["alive"] else click.style("no", fg="red")
        labels = ", ".join(f"{k}={v}" for k, v in sorted(r["labels"].items())
                           if k in SHOWN_LABELS)
        cells.append([r["id"], r["via"], alive, seconds(r["expires_in"]),
                      labels + ("  [draining]" if r["draining"] else "")])
    return table(["WORKER", "VIA", "ALIVE", "EXPIRES IN", "LABELS"], cells, right=[3])


def claims_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The claims table (``pulse claims``)."""
    if not rows:
        return ["no claims"]
    cells = [[r["task_id"], r["state"], r["holder"] or "-", str(r["epoch"]),
              "-" if r["lease_remaining"] is None else seconds(r["lease_remaining"]),
              f"{r['attempts']}/{r['max_attempts']}", checkpoint_cell(r), r["task"]]
             for r in rows]
    return table(["TASK ID", "STATE", "HOLDER", "EPOCH", "LEASE", "ATTEMPTS", "CHECKPOINT",
                  "TASK"], cells, right=[3, 4, 5])


def checkpoint_cell(row: dict[str, Any]) -> str:
    """A claim's last checkpoint in a table: its size and age (or when, without a clock)."""
    if row.get("checkpoint_at") is None:
        return "-"
    age = row.get("checkpoint_age")
    when = f"{age:.1f}s ago" if age is not None else iso(row["checkpoint_at"])
    return f"{row['checkpoint_size']} B, {when}"


def entered_review(item: dict[str, Any]) -> str:
    """When the task entered review, or (not recorded) the bound the store does know."""
    if item.get("entered_review_at") is not None:
        return iso(item["entered_review_at"])
    return f"after {iso(item.get('started_at') or item['since'])}"


def review_lines(items: list[dict[str, Any]], app: str) -> list[str]:
    """The review table, then the two commands that close an item (``pulse review``)."""
    if not items:
        return ["nothing needs review"]
    cells = [[i["task_id"], i["task_name"], i["last_holder"] or "-", str(i["epoch"]),
              str(i["attempts"]), entered_review(i), checkpoint_cell(i), i["args_summary"]]
             for i in items]
    lines = table(["TASK ID", "TASK", "LAST HOLDER", "EPOCH", "ATTEMPTS", "IN REVIEW SINCE",
                   "CHECKPOINT", "ARGS"], cells, right=[3, 4])
    if any(i.get("entered_review_at") is None for i in items):
        lines.append("(after T: Recover moved the task to review before the store kept the "
                     "time of that; T is when its last attempt started)")
    lines += [f"{len(items)} task(s) ran with an unknown outcome: check what each one did",
              f"  celery -A {app} pulse review show TASK_ID         its attempts' late results, then",
              f"  celery -A {app} pulse review retry TASK_ID        run it once more",
              f"  celery -A {app} pulse review resolve TASK_ID --outcome succeeded|failed"
              "    close it by hand"]
    return lines


def retention_line(retention: dict[str, float]) -> str:
    """Retention's lag: yellow once the purge is more than an interval (and its time
    budget) behind."""
    line = (f"retention: oldest finished claim {retention['lag']:.1f}s past "
            f"pulse_retention ({retention['retention']:g}s), purge every "
            f"{retention['purge_interval']:g}s")
    behind = retention["lag"] > retention["purge_interval"] + 1.0
    return click.style(line, fg="yellow") if behind else line


def status_lines(payload: dict[str, Any]) -> list[str]:
    """The cluster at a glance (``pulse status``)."""
    c = payload["claims"]
    lines = [click.style("celery-pulse", bold=True) + f"  store {payload['store']}",
             f"workers: {payload['workers_alive']} alive, {payload['workers_dead']} dead"]
    lines += workers_lines(payload["workers"])
    leader = payload["leader"]
    if leader is None or not leader["alive"]:
        line = "leader: none"
        lines.append(click.style(line, fg="yellow") if payload["schedule"] else line)
    else:
        lines.append(f"leader: {leader['holder']} (epoch {leader['epoch']}, lease "
                     f"{seconds(leader['lease_remaining'])})")
    lines.append(f"claims: {c['running']} running, {c['reserved']} reserved, {c['open']} "
                 f"waiting for redelivery, {c['expired']} expired, {c['succeeded']} "
                 f"succeeded, {c['failed']} failed, {c['revoked']} revoked")
    for permit in payload["permits"]:
        if (permit["running"] or permit["waiting"]) and permit.get("window") is not None:
            lines.append(f"rate {permit['key']}: {permit['running']} of {permit['limit']} "
                         f"started in the last {permit['window']:g}s, {permit['waiting']} "
                         f"waiting")
        elif permit["running"] or permit["waiting"]:
            lines.append(f"permits {permit['key']}: {permit['running']} of {permit['limit']} "
                         f"running, {permit['waiting']} waiting")
    lines.append(retention_line(payload["retention"]))
    review_line = f"needs review: {c['needs_review']}"
    lines.append(click.style(review_line, fg="red") if c["needs_review"] else review_line)
    lines += [click.style(f"! {problem}", fg="red") for problem in payload["needs_attention"]]
    return lines


#: How much of a checkpoint's value ``review show`` prints (``--json`` has all of it).
CHECKPOINT_SHOWN = 200


def checkpoint_line(checkpoint: dict[str, Any] | None) -> str:
    """How far the task got, by its last checkpoint (``pulse review show``)."""
    if checkpoint is None:
        return "checkpoint: none"
    value = json.dumps(checkpoint["value"], sort_keys=True)
    if len(value) > CHECKPOINT_SHOWN:
        value = value[:CHECKPOINT_SHOWN] + "…"
    return (f"checkpoint: {value} (epoch {checkpoint['epoch']}, {checkpoint['size']} B, "
            f"written {iso(checkpoint['written_at'])})")


def detail_lines(payload: dict[str, Any]) -> list[str]:
    """One claim, its evidence and its review decisions (``pulse review show``)."""
    c = payload["claim"]
    lines = [f"{c['task_id']}  {c['task_name']}  {c['state']} at epoch {c['epoch']} "
             f"(holder {c['holder'] or '-'}, attempts {c['attempts']} of {c['max_attempts']})",
             f"args: {payload['args_summary'] or '-'}",
             checkpoint_line(payload.get("checkpoint"))]
    evidence = payload["evidence"]
    if evidence:
        lines.append("late outcomes of stale attempts (evidence, never applied):")
        lines += table(["EPOCH", "HOLDER", "OUTCOME", "RESULT", "ERROR", "RECORDED"],
                       [[str(e["epoch"]), e["holder"], e["outcome"], e["result"] or "-",
                         e["error"] or "-", iso(e["recorded_at"])] for e in evidence],
                       right=[0])
    else:
        lines.append("no late outcome kept (evidence: none)")
    for r in payload["reviews"]:
        lines.append(f"{iso(r['decided_at'])} {r['decided_by']}: {r['action']}"
                     f"{' ' + r['outcome'] if r['outcome'] else ''}"
                     f"{': ' + r['note'] if r['note'] else ''}")
    return lines
