"""``python -m celery_suite fetch|run|passlist|check``: Celery's integration suite, prefork vs pulse.

``--backend redis`` (the default) or ``--backend pulse`` (result_backend = pulse+<the run's
private PostgreSQL store>): each backend has its own pass list and default modules.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

from celery_suite import BACKENDS, CACHE_DIR, EXCEPTIONS_FILE, celery_version, default_modules, passlist_file
from celery_suite.runner import RunResult, log, run_name, run_suite, summary, write_lists

DEFAULT_TIMEOUT = 60.0
DEFAULT_BUDGET = 40 * 60.0  # run, passlist: a full prefork run of the default modules takes ~19 min
#: check's budgets per backend (first run, then the one re-run): the pulse side took ~13 min on
#: redis and ~5.5 min on pulse (docs/celery-suite.md); CI must stay bounded.
DEFAULT_CHECK_BUDGETS = {"redis": 20 * 60.0, "pulse": 8 * 60.0}
DEFAULT_RERUN_BUDGETS = {"redis": 8 * 60.0, "pulse": 3 * 60.0}
RESULTS_DIR = CACHE_DIR / "results"
#: The ``# backend:`` line of a pass list's header.
BACKEND_DESCRIPTIONS = {
    "redis": "redis://127.0.0.1:6379/9",
    "pulse": "pulse+postgresql+psycopg://root@127.0.0.1:5432/<the run's private database>",
}


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
    """The ``# key: value`` lines at the top of a pass list."""
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
                       junit=Path(args.junit).resolve() if args.junit else None, backend=args.backend)
    name = run_name(args.pool, args.backend)
    passed, failed = write_lists(result, Path(args.out_dir), name)
    log(summary(result))
    log(f"lists: {passed} ({len(result.passed)}), {failed} ({len(result.not_passed)})")
    print(f"celery-suite {name}: {len(result.passed)} passed, {len(result.not_passed)} failed")
    return 0


def cmd_passlist(args: argparse.Namespace) -> int:
    runs: list[RunResult] = []
    name = run_name("prefork", args.backend)
    target = passlist_file(args.backend)
    for n in range(args.runs):
        result = run_suite("prefork", args.modules, timeout=args.timeout, budget=args.budget,
                           label=f"passlist{n + 1}", backend=args.backend)
        write_lists(result, RESULTS_DIR, f"{name}-passlist{n + 1}")
        log(f"run {n + 1}/{args.runs}: {summary(result)}")
        runs.append(result)
    kept = set(runs[0].passed)
    for result in runs[1:]:
        kept &= set(result.passed)
    flaky = sorted(set().union(*(r.passed for r in runs)) - kept)
    backend_arg = "" if args.backend == "redis" else f" --backend {args.backend}"
    command = ("python -m celery_suite passlist{} --runs {} --timeout {:g} --budget {:g} --modules {}"
               .format(backend_arg, args.runs, args.timeout, args.budget, " ".join(args.modules)))
    header = [
        "# Celery t/integration tests that passed against an external `celery worker -P prefork -c 4`",
        f"# in every run; `python -m celery_suite check{backend_arg}` expects them to pass on -P pulse too.",
        f"# backend: {BACKEND_DESCRIPTIONS[args.backend]}",
        f"# celery: {celery_version()}",
        f"# modules: {' '.join(args.modules)}",
        f"# timeout: {args.timeout:g}",
        f"# runs: {args.runs}  (collected {len(runs[0].collected)}; passed per run: "
        f"{', '.join(str(len(r.passed)) for r in runs)}; kept {len(kept)}; dropped as flaky {len(flaky)})",
        f"# date: {datetime.date.today().isoformat()}",
        f"# command: {command}",
    ]
    target.write_text("\n".join(header) + "\n" + "".join(f"{i}\n" for i in sorted(kept)))
    if flaky:
        log("passed in some prefork runs but not all (left out):")
        for test_id in flaky:
            print(f"  {test_id}")
    log(f"wrote {target} ({len(kept)} ids)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    source = passlist_file(args.backend)
    backend_arg = "" if args.backend == "redis" else f" --backend {args.backend}"
    if not source.exists():
        log(f"{source} is missing: run `python -m celery_suite passlist{backend_arg}`")
        return 2
    header = read_header(source)
    if header.get("celery") != celery_version():
        log(f"{source.name} is for celery {header.get('celery')}, the installed one is "
            f"{celery_version()}: regenerate it with `python -m celery_suite passlist{backend_arg}` "
            "(docs/celery-suite.md)")
        return 2
    if header.get("backend", BACKEND_DESCRIPTIONS[args.backend]) != BACKEND_DESCRIPTIONS[args.backend]:
        log(f"{source.name} was made with the backend {header['backend']!r}, not {args.backend}")
        return 2
    modules = header.get("modules", "").split() or list(default_modules(args.backend))
    timeout = float(args.timeout or header.get("timeout") or DEFAULT_TIMEOUT)
    budget = args.budget if args.budget is not None else DEFAULT_CHECK_BUDGETS[args.backend]
    exceptions = read_ids(EXCEPTIONS_FILE)
    expected = sorted(set(read_ids(source)) - set(exceptions))
    name = run_name("pulse", args.backend)
    log(f"expecting {len(expected)} ids of {source.name} to pass on pulse ({len(exceptions)} "
        f"exceptions); modules: {' '.join(modules)}")
    result = run_suite("pulse", modules, timeout=timeout, budget=budget, only=expected, label="check",
                       backend=args.backend)
    write_lists(result, RESULTS_DIR, f"{name}-check")
    log(summary(result))
    failing = [i for i in expected if result.status(i) != "passed"]
    rerun_passed: list[str] = []
    if failing and not args.no_rerun:
        log(f"{len(failing)} ids did not pass on pulse; re-running them once (upstream tests are flaky):")
        _print_failures(result, failing)
        rerun_budget = (args.rerun_budget if args.rerun_budget is not None
                        else DEFAULT_RERUN_BUDGETS[args.backend])
        again = run_suite("pulse", modules, timeout=timeout, budget=rerun_budget, only=failing,
                          label="rerun", backend=args.backend)
        write_lists(again, RESULTS_DIR, f"{name}-rerun")
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
    print(f"celery-suite {name}: {len(expected) - len(failing)} passed, {len(failing)} failed")
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_suite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download the celery sdist and extract t/").set_defaults(func=cmd_fetch)

    def common(p: argparse.ArgumentParser, modules: bool = True) -> None:
        p.add_argument("--backend", choices=BACKENDS, default="redis",
                       help="result backend of the worker and the tests: redis (redis://127.0.0.1:6379/9) "
                            "or pulse (pulse+<the run's private PostgreSQL store>); default redis")
        if modules:
            p.add_argument("--modules", nargs="+", default=None, metavar="MODULE",
                           help="t/integration modules (default: the backend's default modules)")
        p.add_argument("--timeout", type=float, default=None if not modules else DEFAULT_TIMEOUT,
                       help="per-test timeout cap, seconds (check: the pass list's)")
        p.add_argument("--budget", type=float, default=DEFAULT_BUDGET if modules else None,
                       help="no test starts after this many seconds of pytest (the rest is 'not run'); "
                            "check: {:g} (redis) / {:g} (pulse)".format(*DEFAULT_CHECK_BUDGETS.values()))

    run = sub.add_parser("run", help="one run against an external worker")
    run.add_argument("--pool", choices=("prefork", "pulse"), required=True)
    run.add_argument("--junit", default=None, help="also write a JUnit XML file")
    run.add_argument("--out-dir", default=str(RESULTS_DIR), help="where the passed/failed lists go")
    common(run)
    run.set_defaults(func=cmd_run)

    passlist = sub.add_parser("passlist", help="regenerate the backend's pass list from prefork runs")
    passlist.add_argument("--runs", type=int, default=2)
    common(passlist)
    passlist.set_defaults(func=cmd_passlist)

    check = sub.add_parser("check", help="pulse vs the prefork pass list; non-zero on a regression")
    check.add_argument("--no-rerun", action="store_true", help="judge on the first run only")
    check.add_argument("--rerun-budget", type=float, default=None,
                       help="time budget of the one re-run of the ids that did not pass, seconds: "
                            "{:g} (redis) / {:g} (pulse)".format(*DEFAULT_RERUN_BUDGETS.values()))
    common(check, modules=False)
    check.set_defaults(func=cmd_check)

    args = parser.parse_args(argv)
    if getattr(args, "modules", "") is None:
        args.modules = list(default_modules(args.backend))
    log(f"{shlex.join(['python', '-m', 'celery_suite', *(argv if argv is not None else sys.argv[1:])])}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
