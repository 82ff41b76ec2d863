#!/usr/bin/env bash
# K data servers and a torchrun job of N ranks on this machine, over loopback, on synthetic data;
# everything is torn down when the job ends, fails, or on Ctrl-C. Options: --help.
#   bash deploy/local/launch.sh --servers 2 --ranks 2 --epochs 2
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/deploy/local/setup-venv.sh" dev
exec python "$ROOT/deploy/local/launch.py" "$@"
