"""The peers, and how one pass of each is run: a reader script in the peer's own environment, as a
child process of its own session, which prints one JSON line of measurements.

The benchmark's process never imports a peer. A reader that outlives its time is killed with
everything it started (its process group); a reader that fails names why, and the benchmark
records the peer as not run rather than failing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import ROOT
from benchmarks.peers import venvs

__all__ = ["Peer", "PEERS", "WINDOWS_PEERS", "FUELLINE", "ReaderFailed", "run_reader", "python_of", "netns_available", "reader_env"]

PEERS_DIR = Path(__file__).resolve().parent
# A loopback-only network namespace: the servers of tf.data service and of Ray bind every
# interface whatever they are told, and there they can reach nothing but 127.0.0.1.
NETNS = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']


@dataclass(frozen=True)
class Peer:
    key: str  # as --peers names it
    name: str  # as the report names it
    script: str  # the reader, in benchmarks/peers/
    env: str | None = None  # its environment (venvs.ENVS); None: this interpreter (fuelline's)
    workers: int = 0
    netns: bool = False  # run in a loopback-only network namespace
    prepare: bool = False  # the reader writes its own copy of the table first (--prepare)
    extra: tuple[str, ...] = ()  # more options of its reader
    block_all: bool = False  # fuelline with every recording in one shuffle block (the count known at run time)


FUELLINE = "fuelline serve → ServerDataStream(tensors=True)"
PEERS = (
    Peer("fuelline", FUELLINE, "read_fuelline.py"),
    # Every row group of the table in one shuffle block: batches as mixed as a uniform shuffle's.
    Peer("fuelline-block80", "fuelline serve --shuffle-block 80", "read_fuelline.py", extra=("--shuffle-block", "80")),
    Peer("dataloader-0", "DataLoader over pyarrow, 0 workers", "read_pyarrow.py"),
    Peer("dataloader-2", "DataLoader over pyarrow, 2 workers", "read_pyarrow.py", workers=2),
    Peer("mosaic-0", "Mosaic Streaming, 0 workers", "read_mosaic.py", "mosaic", prepare=True),
    Peer("mosaic-2", "Mosaic Streaming, 2 workers", "read_mosaic.py", "mosaic", workers=2, prepare=True),
    Peer("litdata-0", "LitData, 0 workers", "read_litdata.py", "litdata", prepare=True),
    Peer("litdata-2", "LitData, 2 workers", "read_litdata.py", "litdata", workers=2, prepare=True),
    Peer("ray", "Ray Data, local shuffle buffer", "read_ray.py", "ray", netns=True),
    Peer("tfdata", "tf.data service, dispatcher + worker", "read_tfdata.py", "tfdata", netns=True, prepare=True),
)
# The windows workload: fuelline serves the converted recordings, aligning as it serves; the others
# read the same windows materialised (benchmarks/peers/windows_data.py).
WINDOWS_PEERS = (
    PEERS[0],
    # Every window aligned again every epoch: no decoded recordings kept from the first.
    Peer("fuelline-decode", "fuelline serve --decoded-cache-mb 0", "read_fuelline.py", extra=("--decoded-cache-mb", "0")),
    # Every recording in one shuffle block: batches as mixed as a uniform shuffle's (named at run time).
    Peer("fuelline-all", "fuelline serve, every recording in one shuffle block", "read_fuelline.py", block_all=True),
    *(p for p in PEERS if not p.key.startswith("fuelline")),
)


class ReaderFailed(RuntimeError):
    pass


def python_of(peer: Peer) -> str:
    return sys.executable if peer.env is None else str(venvs.ENVS[peer.env].python)


def netns_available() -> str | None:
    """None if a loopback-only network namespace can be made here, else why not."""
    try:
        done = subprocess.run([*NETNS, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no loopback-only network namespace to confine its servers in ({exc})"
    if done.returncode:
        return f"no loopback-only network namespace to confine its servers in (unshare --net: {done.stderr.strip()[:200]})"
    return None


def reader_env(peer: Peer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    if peer.env is None:  # fuelline's reader uses benchmarks.common
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(RAY_USAGE_STATS_ENABLED="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    return env


def run_reader(peer: Peer, options: dict[str, Any], log: Path, timeout: float, prepare: bool = False,
               prefix: Sequence[str] | None = None, extra: Sequence[str] = ()) -> dict[str, Any]:
    """One pass of ``peer`` (or, with ``prepare``, its one-time conversion): its JSON line, parsed.
    Raises ``ReaderFailed`` with the reader's own words when it fails or outlives ``timeout``.
    ``prefix``: what runs it (a bed host's ``command([])``) instead of the loopback-only namespace;
    ``extra``: more options of its reader."""
    argv = [python_of(peer), str(PEERS_DIR / peer.script), "--workers", str(peer.workers)]
    for k, v in options.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    argv += [*peer.extra, *extra]
    if prepare:
        argv.append("--prepare")
    if prefix is not None:
        argv = [*prefix, *argv]
    elif peer.netns:
        argv = [*NETNS, *argv]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as err:
        err.write("$ " + " ".join(argv) + "\n")
        err.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=reader_env(peer), stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ReaderFailed(f"no result within {timeout:.0f}s") from exc
        finally:
            _end_group(proc)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    if "error" in result:
        raise ReaderFailed(result["error"])
    if proc.returncode or not result:
        tail = " / ".join(log.read_text(errors="replace").splitlines()[-3:])
        raise ReaderFailed(f"exited {proc.returncode} without a result: {tail[-600:]}")
    return result


def _end_group(proc: subprocess.Popen[str]) -> None:
    """Kill the reader, if it still runs, and whatever it started that is still in its process
    group (its session's, which it leads), then reap it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
