#!/usr/bin/env bash
# Smoke the published extras the way a user installs them: a fresh venv holding only
# `pip install ".[postgres,redis]"` (not editable, no dev extra), then one real
# `celery worker -P pulse` per broker (RabbitMQ, Redis) via tests/smoke/extras_smoke.py.
# Needs PostgreSQL, RabbitMQ and Redis up on 127.0.0.1 (as .ci/run leaves them).
#
# The app and the script run from a copy outside the repo with PYTHONPATH at that copy only:
# at the repo root the source tree's celery_pulse would shadow the installed one, and this
# run is meant to prove the installed distribution (its dependencies and package data) works.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/.venv-smoke
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "== fresh venv $venv with .[postgres,redis]"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q ".[postgres,redis]" </dev/null

work=$(mktemp -d "${TMPDIR:-/tmp}/pulse-smoke-XXXXXX")
trap 'rm -rf "$work"' EXIT
cp tests/apps/pulseapp.py tests/smoke/extras_smoke.py "$work/"
cd "$work"
export PYTHONPATH=$work

origin=$("$venv/bin/python" -c 'import celery_pulse; print(celery_pulse.__file__)' </dev/null)
case $origin in
  "$venv"/*) echo "celery_pulse is the installed one: $origin" ;;
  *) echo "celery_pulse comes from $origin, not from $venv" >&2; exit 1 ;;
esac

echo "== smoke test, one worker per broker"
"$venv/bin/python" "$work/extras_smoke.py" --app pulseapp </dev/null
