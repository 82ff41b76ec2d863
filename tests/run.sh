#!/usr/bin/env bash
# Install what the tests need into .venv and run the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/deploy/local/setup-venv.sh" dev
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider "$@"
