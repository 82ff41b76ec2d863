#!/usr/bin/env bash
# Install what the tests need into .venv, lint and type-check, and run the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/deploy/local/setup-venv.sh" dev
cd "$ROOT"
# The linter and the type checker first: findings fail the run before the suite starts.
bash "$ROOT/.ci/lint"
exec python -m pytest -q -p no:cacheprovider "$@"
