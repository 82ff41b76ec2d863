"""tf.data service (``tensorflow-cpu``): a ``DispatchServer`` and a ``WorkerServer``, each in a
process of its own, and this reader as the client: ``dataset.apply(tf.data.experimental.service
.distribute("parallel_epochs", …))``, each epoch another job of the service.

TensorFlow has no Parquet reader of its own, and a dataset the service runs cannot call Python, so
the table is converted once to fixed-length binary records (272 bytes: 64 float32 features, the
int64 label, the int64 row id; a file per row group), which the worker reads with TensorFlow's own
ops: the files in a shuffled order, 8 interleaved, a row shuffle buffer of ``--shuffle-rows``
records, batches of 1024 decoded with ``decode_raw`` and ``bitcast``. The windows are converted the
same way, a record a window (its sources one after the other, each reshaped to its shape when
decoded), a file per recording. The client hands each batch on
as numpy (``.numpy()``), as a PyTorch training loop would take it.

The servers bind every interface (their gRPC servers take no address), so the benchmark runs this
reader in a network namespace of its own that has only a loopback interface; the worker advertises
127.0.0.1.
"""

from __future__ import annotations

import json
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import readerlib


def _record_dtype(cols: list[readerlib.Column]) -> np.dtype:
    """A record: the columns one after the other, packed."""
    return np.dtype([(c.name, c.dtype, c.shape) for c in cols])


def prepare(data: Path) -> None:
    """Write ``data/records`` from ``data/parquet`` once (a file per row group)."""
    import pyarrow.parquet as pq

    out = data / "records"
    if out.is_dir():
        return
    tmp = data / "records.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    cols = readerlib.columns(data)
    row = _record_dtype(cols)
    n = 0
    for path in sorted((data / "parquet").glob("*.parquet")):
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            arrays = readerlib.table_arrays(pf.read_row_group(g), cols)
            records = np.empty(pf.metadata.row_group(g).num_rows, row)
            for c in cols:
                records[c.name] = arrays[c.name]
            (tmp / f"group-{n:04d}.bin").write_bytes(records.tobytes())
            n += 1
    tmp.rename(out)


def serve(role: str, dispatcher: str, advertise: str) -> int:
    """A dispatcher (prints its address) or a worker of ``dispatcher`` reached at ``advertise``,
    until terminated."""
    import tensorflow as tf

    service = tf.data.experimental.service
    if role == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(port=0))
        print(f"ready {server.target}", flush=True)
    else:
        server = service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher, worker_address=f"{advertise}:%port%",
                                                           port=0))
        print("ready", flush=True)
    server.join()
    return 0


def _start(role: str, dispatcher: str, timeout: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", role, "--dispatcher", dispatcher, "--data", ".",
                             "--rows-per-group", "1", "--rows", "1"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {role} exited with status {proc.wait(timeout=10)} before it was ready")
        if line.startswith("ready"):
            return proc, line.split(" ", 1)[1].strip() if " " in line else ""
    proc.kill()
    raise TimeoutError(f"the {role} was not ready within {timeout:.0f}s")


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _interfaces() -> list[str]:
    """The network interfaces this process sees (its network namespace's, from /proc/self/net/dev)."""
    with open("/proc/self/net/dev") as f:
        return sorted(line.split(":", 1)[0].strip() for line in f if ":" in line)


def main() -> int:
    p = readerlib.parser(__doc__)
    p.add_argument("--serve", choices=("dispatcher", "worker"), help="run a server of the service (internal)")
    p.add_argument("--dispatcher", default="", help="the dispatcher's address, for --serve worker")
    p.add_argument("--advertise", default="127.0.0.1", help="the address a worker is reached at, for --serve worker")
    p.add_argument("--service", default=None, metavar="grpc://HOST:PORT",
                   help="read from this dispatcher (started by the benchmark on another host) instead of starting one")
    args = p.parse_args()
    if args.serve:
        return serve(args.serve, args.dispatcher, args.advertise)
    data = Path(args.data)
    if args.prepare:
        reused = (data / "records").is_dir()
        started = time.perf_counter()
        prepare(data)
        print(json.dumps({"prepared_s": round(time.perf_counter() - started, 2), "reused": reused}), flush=True)
        return 0
    procs: list[subprocess.Popen[str]] = []
    try:
        with readerlib.ProcTree() as tree:
            server_started: float | None = None
            if args.service:
                target = args.service
            else:
                server_started = time.perf_counter()
                dispatcher, target = _start("dispatcher", "", args.timeout)
                procs.append(dispatcher)
                procs.append(_start("worker", target.removeprefix("grpc://"), args.timeout)[0])
            import tensorflow as tf

            cols = readerlib.columns(data)
            record_bytes = _record_dtype(cols).itemsize
            started = time.perf_counter()
            files = tf.data.Dataset.list_files(str(data / "records" / "*.bin"), shuffle=True, seed=args.seed)
            rows = files.interleave(lambda f: tf.data.FixedLengthRecordDataset(f, record_bytes), cycle_length=8,
                                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
            rows = rows.shuffle(args.shuffle_rows, seed=args.seed)

            def decode(records: Any) -> tuple[Any, ...]:
                raw = tf.io.decode_raw(records, tf.uint8)
                out, at = [], 0
                for c in cols:
                    itemsize = np.dtype(c.dtype).itemsize
                    part = tf.reshape(raw[:, at:at + c.row_bytes], [-1, *c.shape, itemsize])
                    out.append(tf.bitcast(part, tf.as_dtype(np.dtype(c.dtype))))
                    at += c.row_bytes
                return tuple(out)

            batches = rows.batch(args.batch_size).map(decode, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
            distributed = batches.apply(tf.data.experimental.service.distribute("parallel_epochs", target))

            def epoch(e: int) -> Any:
                return iter(distributed)

            result = readerlib.measure(tree, epoch, args, started, server_started)
            peak, names = tree.peak_rss_bytes(), tree.process_names()
            _stop(procs)
            readerlib.emit(result, tree, peak_rss_bytes=peak, processes=names, versions={"tensorflow": tf.__version__},
                           interfaces=_interfaces())
        return 0
    except Exception as exc:
        return readerlib.fail(exc)
    finally:
        _stop(procs)


if __name__ == "__main__":
    raise SystemExit(main())
