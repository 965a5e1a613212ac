"""``python -m celery_suite fetch|run|passlist|check``: Celery's integration suite, prefork vs pulse."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

from celery_suite import CACHE_DIR, DEFAULT_MODULES, EXCEPTIONS_FILE, PASSLIST_FILE, celery_version
from celery_suite.runner import RunResult, log, run_suite, summary, write_lists

DEFAULT_TIMEOUT = 60.0
DEFAULT_BUDGET = 40 * 60.0  # run, passlist: a full prefork run of the default modules takes ~19 min
DEFAULT_CHECK_BUDGET = 20 * 60.0  # check: the pulse side took ~13 min; CI must stay bounded
DEFAULT_RERUN_BUDGET = 8 * 60.0
RESULTS_DIR = CACHE_DIR / "results"


def read_ids(path: Path) -> dict[str, str]:
    """``id  # comment`` lines -> {id: comment}; blank and ``#`` lines are skipped."""
    ids: dict[str, str] = {}
    if not path.exists():
        return ids
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        test_id, _, comment = text.partition(" #")
        ids[test_id.strip()] = comment.strip()
    return ids


def read_header(path: Path) -> dict[str, str]:
    """The ``# key: value`` lines at the top of prefork_passed.txt."""
    header: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line[1:].partition(":")
        if sep:
            header[key.strip()] = value.strip()
    return header


def _print_failures(result: RunResult, ids: list[str]) -> None:
    for test_id in ids:
        message = result.messages.get(test_id, "")
        print(f"  {test_id}  [{result.status(test_id)}] {message}")


def cmd_fetch(_args: argparse.Namespace) -> int:
    from celery_suite.fetch import fetch

    print(fetch())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    result = run_suite(args.pool, args.modules, timeout=args.timeout, budget=args.budget,
                       junit=Path(args.junit).resolve() if args.junit else None)
    passed, failed = write_lists(result, Path(args.out_dir), args.pool)
    log(summary(result))
    log(f"lists: {passed} ({len(result.passed)}), {failed} ({len(result.not_passed)})")
    print(f"celery-suite {args.pool}: {len(result.passed)} passed, {len(result.not_passed)} failed")
    return 0


def cmd_passlist(args: argparse.Namespace) -> int:
    runs: list[RunResult] = []
    for n in range(args.runs):
        result = run_suite("prefork", args.modules, timeout=args.timeout, budget=args.budget,
                           label=f"passlist{n + 1}")
        write_lists(result, RESULTS_DIR, f"prefork-passlist{n + 1}")
        log(f"run {n + 1}/{args.runs}: {summary(result)}")
        runs.append(result)
    kept = set(runs[0].passed)
    for result in runs[1:]:
        kept &= set(result.passed)
    flaky = sorted(set().union(*(r.passed for r in runs)) - kept)
    command = ("python -m celery_suite passlist --runs {} --timeout {:g} --budget {:g} --modules {}"
               .format(args.runs, args.timeout, args.budget, " ".join(args.modules)))
    header = [
        "# Celery t/integration tests that passed against an external `celery worker -P prefork -c 4`",
        "# in every run; `python -m celery_suite check` expects them to pass on -P pulse too.",
        f"# celery: {celery_version()}",
        f"# modules: {' '.join(args.modules)}",
        f"# timeout: {args.timeout:g}",
        f"# runs: {args.runs}  (collected {len(runs[0].collected)}; passed per run: "
        f"{', '.join(str(len(r.passed)) for r in runs)}; kept {len(kept)}; dropped as flaky {len(flaky)})",
        f"# date: {datetime.date.today().isoformat()}",
        f"# command: {command}",
    ]
    PASSLIST_FILE.write_text("\n".join(header) + "\n" + "".join(f"{i}\n" for i in sorted(kept)))
    if flaky:
        log("passed in some prefork runs but not all (left out):")
        for test_id in flaky:
            print(f"  {test_id}")
    log(f"wrote {PASSLIST_FILE} ({len(kept)} ids)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if not PASSLIST_FILE.exists():
        log(f"{PASSLIST_FILE} is missing: run `python -m celery_suite passlist`")
        return 2
    header = read_header(PASSLIST_FILE)
    if header.get("celery") != celery_version():
        log(f"{PASSLIST_FILE.name} is for celery {header.get('celery')}, the installed one is "
            f"{celery_version()}: regenerate it with `python -m celery_suite passlist` "
            "(docs/celery-suite.md)")
        return 2
    modules = header.get("modules", "").split() or list(DEFAULT_MODULES)
    timeout = float(args.timeout or header.get("timeout") or DEFAULT_TIMEOUT)
    exceptions = read_ids(EXCEPTIONS_FILE)
    expected = sorted(set(read_ids(PASSLIST_FILE)) - set(exceptions))
    log(f"expecting {len(expected)} ids to pass on pulse ({len(exceptions)} exceptions); modules: "
        f"{' '.join(modules)}")
    result = run_suite("pulse", modules, timeout=timeout, budget=args.budget, only=expected, label="check")
    write_lists(result, RESULTS_DIR, "pulse-check")
    log(summary(result))
    failing = [i for i in expected if result.status(i) != "passed"]
    rerun_passed: list[str] = []
    if failing and not args.no_rerun:
        log(f"{len(failing)} ids did not pass on pulse; re-running them once (upstream tests are flaky):")
        _print_failures(result, failing)
        again = run_suite("pulse", modules, timeout=timeout, budget=args.rerun_budget, only=failing,
                          label="rerun")
        write_lists(again, RESULTS_DIR, "pulse-rerun")
        log(summary(again))
        rerun_passed = [i for i in failing if again.status(i) == "passed"]
        failing = [i for i in failing if again.status(i) != "passed"]
        if rerun_passed:
            log(f"NEEDED A RE-RUN to pass on pulse ({len(rerun_passed)}):")
            for test_id in rerun_passed:
                print(f"  {test_id}")
        result = again
    if failing:
        log(f"REGRESSION: {len(failing)} ids passed on prefork and did not pass on pulse "
            f"(worker log: {result.worker_log}):")
        _print_failures(result, failing)
    else:
        log("every prefork-passing id passed on pulse")
    print(f"celery-suite: {len(expected) - len(failing)} passed, {len(failing)} failed")
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_suite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download the celery sdist and extract t/").set_defaults(func=cmd_fetch)

    def common(p: argparse.ArgumentParser, modules: bool = True) -> None:
        if modules:
            p.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES), metavar="MODULE")
        p.add_argument("--timeout", type=float, default=None if not modules else DEFAULT_TIMEOUT,
                       help="per-test timeout cap, seconds (check: the pass list's)")
        p.add_argument("--budget", type=float, default=DEFAULT_BUDGET if modules else DEFAULT_CHECK_BUDGET,
                       help="no test starts after this many seconds of pytest (the rest is 'not run')")

    run = sub.add_parser("run", help="one run against an external worker")
    run.add_argument("--pool", choices=("prefork", "pulse"), required=True)
    run.add_argument("--junit", default=None, help="also write a JUnit XML file")
    run.add_argument("--out-dir", default=str(RESULTS_DIR), help="where the passed/failed lists go")
    common(run)
    run.set_defaults(func=cmd_run)

    passlist = sub.add_parser("passlist", help=f"regenerate {PASSLIST_FILE.name} from prefork runs")
    passlist.add_argument("--runs", type=int, default=2)
    common(passlist)
    passlist.set_defaults(func=cmd_passlist)

    check = sub.add_parser("check", help="pulse vs the prefork pass list; non-zero on a regression")
    check.add_argument("--no-rerun", action="store_true", help="judge on the first run only")
    check.add_argument("--rerun-budget", type=float, default=DEFAULT_RERUN_BUDGET,
                       help="time budget of the one re-run of the ids that did not pass, seconds")
    common(check, modules=False)
    check.set_defaults(func=cmd_check)

    args = parser.parse_args(argv)
    log(f"{shlex.join(['python', '-m', 'celery_suite', *(argv if argv is not None else sys.argv[1:])])}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
