"""``python -m benchmarks run [--quick] [--output DIR] [--only SECTION,...]``."""

from __future__ import annotations

import argparse
import sys

from benchmarks import runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="celery-pulse benchmarks vs plain Celery and RedBeat")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure on this machine and write the report")
    run.add_argument("--quick", action="store_true",
                     help="small sizes, fewer cases (under 3 minutes; used by the test suite)")
    run.add_argument("--output", default=None,
                     help="directory for benchmarks.md, benchmarks.json and img/ (default: docs/)")
    run.add_argument("--only", default=None,
                     help=f"comma-separated sections to run ({', '.join(runner.SECTIONS)})")
    run.add_argument("--no-profile", action="store_true", help="skip the py-spy section")
    run.add_argument("--keep-scratch", action="store_true",
                     help="keep the temporary directory with worker logs")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    return runner.run(quick=args.quick, output=args.output, only=only,
                      with_profile=not args.no_profile, keep_scratch=args.keep_scratch,
                      argv=["python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
