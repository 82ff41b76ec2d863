#!/usr/bin/env bash
# The whole path on one machine, on built-in sample data: synthesise AMIGOS-like raw recordings,
# convert them to Parquet, start a data server that aligns and windows them, stream epochs into a
# client, print what arrived and how fast, stop the server.
#
# It works in a temporary folder (about 300 MB) and removes it when it ends, also on a failure or
# Ctrl-C. To keep what it made, name a folder: FUELLINE_DEMO_DIR=DIR (kept, and reused next time),
# or FUELLINE_DEMO_KEEP=1 (the temporary folder is kept, and named at the end).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/deploy/local/setup-venv.sh"
SERVER_PID=""
TEMPORARY=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true; fi
    if [ -n "$TEMPORARY" ]; then
        if [ "${FUELLINE_DEMO_KEEP:-0}" = 1 ]; then echo "kept $TEMPORARY"; else rm -rf "$TEMPORARY"; fi
    fi
}
trap cleanup EXIT
# Without these, a signal would end the script without its EXIT trap.
trap 'exit 130' INT
trap 'exit 143' TERM
if [ -n "${FUELLINE_DEMO_DIR:-}" ]; then
    WORK="$FUELLINE_DEMO_DIR"
    mkdir -p "$WORK"
else
    TEMPORARY="$(mktemp -d -t fuelline-demo.XXXXXX)"
    WORK="$TEMPORARY"
fi
rm -rf "$WORK/raw" "$WORK/data"

echo "== 1. synthesise 40 raw recordings of 60 s (EEG, ECG, GSR, face video; each device on its own clock)"
fuelline synth "$WORK/raw" --recordings 40 --seconds 60 --seed 0

echo "== 2. convert the raw TSV to Parquet shards"
fuelline convert "$WORK/raw" "$WORK/data"

echo "== 3. what a server will serve"
fuelline inspect "$WORK/data"

echo "== 4. data server: 2 s windows every 1 s, z-scored (log: $WORK/serve.log)"
fuelline serve "$WORK/data" --port 0 --batch-size 64 --window 2.0 --hop 1.0 >"$WORK/serve.out" 2>"$WORK/serve.log" &
SERVER_PID=$!
for _ in $(seq 300); do
    grep -q "serving on" "$WORK/serve.out" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.log"; exit 1; }
    sleep 0.1
done
grep "serving on" "$WORK/serve.out" || { echo "server did not start in 30s"; cat "$WORK/serve.log"; exit 1; }
ENDPOINT="$(sed -n 's#^serving on tcp://##p' "$WORK/serve.out")"

echo "== 5. client: two epochs of train, one of val"
fuelline stream "$ENDPOINT" --epochs 2
fuelline stream "$ENDPOINT" --split val

echo "== 6. SIGTERM the server"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" && echo "server exited with 0"
SERVER_PID=""
tail -n 3 "$WORK/serve.log"
