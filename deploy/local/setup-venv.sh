#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install fuelline into it.
#   setup-venv.sh            the data-server install: pyzmq, pyarrow, msgpack, numpy, xxhash
#   setup-venv.sh dev        plus torch (CPU build) and the test tools
# Source it to get the venv activated in the calling shell.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
    "$PYTHON" -m venv "$ROOT/.venv"
fi
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
pip_quiet() { python -m pip install --disable-pip-version-check -q "$@"; }
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
KIND="${1:-server}"
# Reinstall only when the packaging files change (or the install is of another kind).
STAMP="$ROOT/.venv/.fuelline-$KIND"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | python -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    if [ "$KIND" = "dev" ]; then
        # The CPU build first, from PyTorch's CPU index as the README's Install says, so the trainer
        # extra's "torch" never pulls a multi-GB CUDA build. The index is added beside the ones pip is
        # configured with (--extra-index-url, not --index-url): a host that installs from a local
        # mirror or wheel folder and cannot reach download.pytorch.org still gets its torch there.
        # Where both offer 2.13.0, pip takes the CPU index's 2.13.0+cpu (a local version sorts higher).
        # No retries: an index that cannot be reached is passed over at once, not after five tries
        # for each of torch's dependencies.
        python -c "import torch" 2>/dev/null \
            || pip_quiet "torch==2.13.0" --extra-index-url "$TORCH_CPU_INDEX" --retries 0 --timeout 15
        pip_quiet -e "$ROOT[dev,trainer]" 2> >(grep -v -e Warning -e '^ ' -e '^$' >&2)
    else
        pip_quiet -e "$ROOT" 2> >(grep -v -e Warning -e '^ ' -e '^$' >&2)
    fi
    echo "$WANT" > "$STAMP"
fi
