#!/usr/bin/env bash
# Install what the tests need into .venv, lint and type-check, and run the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKERS="${FUELLINE_TEST_WORKERS:-2}"
if ! [[ "$WORKERS" =~ ^([0-9]+|auto)$ ]]; then
    echo "tests/run.sh: FUELLINE_TEST_WORKERS=$WORKERS: expected a number of worker processes (0: none) or auto" >&2
    exit 2
fi
# shellcheck disable=SC1091
source "$ROOT/deploy/local/setup-venv.sh" dev
cd "$ROOT"
# The linter and the type checker first: findings fail the run before the suite starts.
bash "$ROOT/.ci/lint"
# The suite in worker processes (pytest-xdist), each test file whole in one of them so that a file's
# module fixtures are made once: most tests wait on real processes, sockets and deadlines, so two
# workers on two cores take about two thirds of one worker's time. FUELLINE_TEST_WORKERS=0 runs it
# in this process alone.
exec python -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile "$@"
