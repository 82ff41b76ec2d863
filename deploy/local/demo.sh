#!/usr/bin/env bash
# The whole path on one machine, on built-in sample data: make a Parquet dataset, start a data
# server, stream epochs into a client, print what arrived and how fast, stop the server.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/deploy/local/setup-venv.sh"
WORK="${FUELLINE_DEMO_DIR:-$(mktemp -d -t fuelline-demo.XXXXXX)}"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true; fi
}
trap cleanup EXIT

echo "== 1. sample dataset in $WORK/data"
rm -rf "$WORK/data"
fuelline sample "$WORK/data" --rows 200000 --dim 64 --files 8 --row-group-rows 5000

echo "== 2. data server (log: $WORK/serve.log)"
fuelline serve "$WORK/data" --port 0 --batch-size 256 >"$WORK/serve.out" 2>"$WORK/serve.log" &
SERVER_PID=$!
for _ in $(seq 300); do
    grep -q "serving on" "$WORK/serve.out" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.log"; exit 1; }
    sleep 0.1
done
grep "serving on" "$WORK/serve.out" || { echo "server did not start in 30s"; cat "$WORK/serve.log"; exit 1; }
ENDPOINT="$(sed -n 's#^serving on tcp://##p' "$WORK/serve.out")"

echo "== 3. client: two epochs of train, one of val"
fuelline stream "$ENDPOINT" --epochs 2
fuelline stream "$ENDPOINT" --split val

echo "== 4. SIGTERM the server"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" && echo "server exited with 0"
SERVER_PID=""
tail -n 3 "$WORK/serve.log"
