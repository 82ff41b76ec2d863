"""Scaling out a data server: worker processes, and a dataset on S3 behind the local disk cache.

Data: the multimodal benchmark's recordings (``benchmarks.windows``), converted once.

Part 1, workers. Contenders, alternately, each a ``fuelline serve`` process read by one client for
one epoch of aligned windows: ``--workers 0`` (decoding on threads of the serving process), 1 and
2. Besides windows/s it measures what an operator sizes hosts with: the server's CPU seconds per
window (its own and its workers', from /proc) and the bytes each window puts on the wire.

Part 2, storage. The same dataset uploaded to a real S3-protocol server on loopback (moto), served
with ``fuelline serve s3://…``: a cold disk cache (a fresh ``--cache-dir``: every shard is fetched)
against a warm one (the shards already in ``--cache-dir``), beside the local dataset. Each S3 round
starts its own server, so the times include fetching; windows/s counts from the first batch and
"first batch" is the time from starting the server to receiving it.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import RESULTS_DIR, Contender, Round, ServerProcess, alternate, progress, time_batches
from benchmarks.report import Metric, RatioSpec, build_report, environment, server_cpu_ms_per_window, write_results
from benchmarks.windows import (
    BATCH_SIZE,
    HWM,
    QUICK_RECORDINGS,
    QUICK_SECONDS,
    RECORDINGS,
    SECONDS,
    TIMEOUT_S,
    ensure_raw,
)
from fuelline.client import ServerDataStream
from fuelline.server.ingest.convert import convert
from fuelline.server.multimodal.source import WindowSource

__all__ = ["run"]

WORKERS = (0, 1, 2)
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "fuelline-bench",
    "AWS_SECRET_ACCESS_KEY": "fuelline-bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
BUCKET = "fuelline-bench"
LOCAL, COLD, WARM = "local disk", "S3, cold cache", "S3, warm cache"


def _name(workers: int) -> str:
    return f"--workers {workers}"


def serve_argv(dataset: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0",
            "--batch-size", str(BATCH_SIZE), "--hwm", str(HWM), "--status-interval", "0",
            "--decoded-cache-mb", "0", *options]  # every round decodes: workers and storage are what is timed


def read_epoch(server: ServerProcess) -> Round:
    with ServerDataStream(None, host=server.host, port=server.port, hwm=HWM, timeout=TIMEOUT_S,
                          receive_timeout=TIMEOUT_S) as stream:
        return time_batches(stream.get_epoch_iterator(), producer_pid=server.pid)


# -- S3 on loopback ---------------------------------------------------------------------------------
class Moto:
    """moto's S3 server in a child process on a free loopback port."""

    def __init__(self, log_path: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **S3_ENV})
        deadline = time.monotonic() + 30
        while not self._answers():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"moto did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)  # polling a starting server, bounded by the deadline

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    @property
    def env(self) -> dict[str, str]:
        return {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}

    def upload(self, local: str, prefix: str) -> str:
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(access_key=S3_ENV["AWS_ACCESS_KEY_ID"], secret_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                               region=S3_ENV["AWS_DEFAULT_REGION"], scheme="http",
                               endpoint_override=f"127.0.0.1:{self.port}", allow_bucket_creation=True)
        fs.create_dir(BUCKET)
        pafs.copy_files(local, f"{BUCKET}/{prefix}", destination_filesystem=fs)
        return f"s3://{BUCKET}/{prefix}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class TimedServer:
    """A server started per round: the round's Round, plus seconds from start to first batch."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_dir, self.env = name, argv, log_dir, env
        self.first_batch_s: list[float] = []
        self.exits: list[dict[str, Any]] = []

    def run(self, before: Callable[[], None] = lambda: None) -> Round:
        before()
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)  # the server process inherits them
        try:
            started = time.perf_counter()
            with ServerProcess(self.name, self.argv, self.log_dir / f"{len(self.exits)}.log") as server:
                with ServerDataStream(None, host=server.host, port=server.port, hwm=HWM, timeout=TIMEOUT_S,
                                      receive_timeout=TIMEOUT_S) as stream:
                    it = stream.get_epoch_iterator()
                    first = next(it)
                    self.first_batch_s.append(time.perf_counter() - started)
                    r = time_batches(_chain(first, it), producer_pid=server.pid)
            self.exits.append(server.exit_status)
            return r
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _chain(first: Any, rest: Any) -> Any:
    yield first
    yield from rest


# -- the benchmark ----------------------------------------------------------------------------------
def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False) -> list[dict[str, Any]]:
    """``quick``: the same benchmark on the tiny dataset (``benchmarks.windows``' quick size)."""
    env = environment()
    recordings, seconds = (QUICK_RECORDINGS, QUICK_SECONDS) if quick else (RECORDINGS, SECONDS)
    raw = ensure_raw(data_dir, recordings, seconds)
    records = []
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-", dir=data_dir) as work_s, ExitStack() as stack:
        work = Path(work_s)
        dataset = str(work / "converted")
        progress("converting ...")
        convert(str(raw), dataset, progress=False)
        windows = WindowSource(dataset).rows("train")

        # Part 1: worker processes.
        servers = {w: stack.enter_context(ServerProcess(_name(w), serve_argv(dataset, "--workers", str(w)),
                                                        work / f"serve-w{w}.log")) for w in WORKERS}
        contenders = [Contender(_name(w), lambda s=servers[w]: read_epoch(s)) for w in WORKERS]
        wps = Metric("windows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
        cpu = server_cpu_ms_per_window()
        bpw = Metric("KB/window", lambda r: r.bytes / r.rows / 1e3, "{:.1f}")
        results = alternate(contenders, rounds, lambda r: f"{wps.of(r):,.0f} windows/s")
        exits = {name: s.stop() for name, s in ((_name(w), servers[w]) for w in WORKERS)}
        model = scaling_model(results, windows)
        record, md = build_report(
            "scaleout-workers", f"workers — windows/s of one server by worker processes ({os.cpu_count()} cores)",
            results, [wps, cpu, bpw],
            [RatioSpec(_name(1), _name(0)), RatioSpec(_name(2), _name(0)), RatioSpec(_name(2), _name(1))],
            {"rounds": rounds, "recordings": recordings, "seconds": seconds, "train_windows": windows,
             "batch_size": BATCH_SIZE, "hwm": HWM, "workers": list(WORKERS)},
            [f"{rounds} timed rounds, contenders alternately; one client reads one epoch ({windows} windows) per round.",
             "server CPU counts the serving process and its live worker processes (/proc), first batch to last.",
             *model["notes"]],
            env, exits=exits, extra={"scaling_model": model},
        )
        records.append(record)
        print(md, flush=True)
        for path in write_results("scaleout-workers", record, md, results_dir):
            print(f"wrote {path}", flush=True)

        # Part 2: S3 behind the disk cache.
        moto = Moto(work / "moto.log")
        stack.callback(moto.close)
        uri = moto.upload(dataset, "amigos")
        warm_dir, cold_dir = work / "cache-warm", work / "cache-cold"
        s3_env = moto.env
        local = stack.enter_context(ServerProcess(LOCAL, serve_argv(dataset), work / "serve-local.log"))
        cold = TimedServer(COLD, serve_argv(uri, "--cache-dir", str(cold_dir)), work / "cold", s3_env)
        warm = TimedServer(WARM, serve_argv(uri, "--cache-dir", str(warm_dir)), work / "warm", s3_env)
        (work / "cold").mkdir()
        (work / "warm").mkdir()
        contenders = [
            Contender(LOCAL, lambda: read_epoch(local)),
            Contender(COLD, lambda: cold.run(before=lambda: shutil.rmtree(cold_dir, ignore_errors=True))),
            Contender(WARM, lambda: warm.run()),  # its warm-up pass fills the cache
        ]
        results = alternate(contenders, rounds, lambda r: f"{wps.of(r):,.0f} windows/s")
        exits = {LOCAL: local.stop(), COLD: cold.exits[-1], WARM: warm.exits[-1]}
        cache_mb = sum(f.stat().st_size for f in warm_dir.rglob("*") if f.is_file()) / 1e6
        timed = {COLD: cold.first_batch_s[1:], WARM: warm.first_batch_s[1:]}  # the warm-up pass left out
        notes = [
            f"{rounds} timed rounds, contenders alternately; one epoch ({windows} windows) per round.",
            f"S3: moto {moto_version()} on loopback, the dataset under {uri}; each S3 round starts a server "
            "(start-up scan of footers and timestamps by range reads, then shards through --cache-dir).",
            "first batch (median, s): " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in timed.items()),
            f"the warm cache holds {cache_mb:.1f} MB.",
        ]
        record, md = build_report(
            "scaleout-storage", "storage — an epoch from S3 with a cold and a warm disk cache, beside local disk",
            results, [wps, cpu], [RatioSpec(WARM, COLD), RatioSpec(WARM, LOCAL), RatioSpec(COLD, LOCAL)],
            {"rounds": rounds, "recordings": recordings, "seconds": seconds, "train_windows": windows},
            notes, env, exits=exits, extra={"first_batch_s": timed, "cache_mb": cache_mb},
        )
        records.append(record)
        print(md, flush=True)
        for path in write_results("scaleout-storage", record, md, results_dir):
            print(f"wrote {path}", flush=True)
    return records


def moto_version() -> str:
    try:
        from importlib.metadata import version

        return version("moto")
    except Exception:
        return "(unknown version)"


def scaling_model(results: dict[str, list[Round]], windows: int) -> dict[str, Any]:
    """What one window costs, measured with one worker process, and what that means for sizing."""
    rounds = results[_name(1)]
    cpu_per_window = statistics.median((r.producer_cpu_s or 0.0) / r.rows for r in rounds)
    bytes_per_window = statistics.median(r.bytes / r.rows for r in rounds)
    best = max(statistics.median(r.rows / r.seconds for r in rs) for rs in results.values())
    target = 10_000.0
    cores = target * cpu_per_window
    notes = [
        f"scaling model (from --workers 1): {cpu_per_window * 1e3:.3f} CPU ms and {bytes_per_window / 1e3:.1f} KB "
        f"per window, so {target:,.0f} windows/s need about {cores:.1f} server cores and "
        f"{target * bytes_per_window * 8 / 1e9:.2f} Gbit/s between servers and trainers; one server here peaked "
        f"at {best:,.0f} windows/s.",
    ]
    return {"cpu_s_per_window": cpu_per_window, "bytes_per_window": bytes_per_window,
            "cores_per_10k_windows_s": cores, "gbit_s_per_10k_windows_s": target * bytes_per_window * 8 / 1e9,
            "best_windows_per_s": best, "notes": notes}
