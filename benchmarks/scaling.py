"""Scaling: aggregate windows/s of one data server against the number of concurrent clients, and
of one client against the batch size.

Data: the pipeline benchmark's converted recordings (``benchmarks.pipeline``). Clients are
processes (spawned once, reused in every round): in a round with N clients, clients 0…N-1 each
read their rank's share (rank r of world size N) of one epoch at the same time from one
``fuelline serve`` process. Aggregate windows/s is the windows every client received after its
own first batch, over the time from the first client's first batch to the last client's last
batch (one machine's monotonic clock). Batch sizes: one ``fuelline serve --batch-size B`` process
per size, one client each, alternately.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, Contender, Round, ServerProcess, alternate, process_cpu_seconds, progress
from benchmarks.pipeline import REFERENCE_WINDOWS_PER_S, ensure_dataset, sizes
from benchmarks.report import Metric, build_report, environment, server_cpu_ms_per_window, write_results
from fuelline.server.multimodal.source import WindowSource

__all__ = ["run"]

CLIENTS = (1, 2, 4, 8)
HWM = 10
TIMEOUT_S = 60.0


def batch_sizes(quick: bool) -> tuple[int, ...]:
    return (8, 16, 32) if quick else (16, 64, 256)


def epochs_per_round(quick: bool) -> int:
    """Every client reads this many epochs of its share per round, so start-up does not dominate."""
    return 2 if quick else 3


# -- client processes -------------------------------------------------------------------------------
def _client(conn: Connection) -> None:
    """Child process: per request (host, port, rank, world_size, epochs), read that many epochs
    and report (batches, rows, bytes, rows of the first batch, first arrival, last arrival)."""
    from fuelline.client import ServerDataStream

    while conn.poll(30 * TIMEOUT_S):
        job = conn.recv()
        if job is None:
            break
        host, port, rank, world, epochs = job
        try:
            first = last = None
            count = rows = nbytes = first_rows = 0
            with ServerDataStream(None, host=host, port=port, hwm=HWM, rank=rank, world_size=world,
                                  timeout=TIMEOUT_S, receive_timeout=TIMEOUT_S) as stream:
                for _ in range(epochs):
                    for batch in stream.get_epoch_iterator():
                        last = time.monotonic()
                        count += 1
                        for arr in batch:
                            if arr.size:
                                arr.item(0)
                        rows += len(batch[0])
                        nbytes += sum(arr.nbytes for arr in batch)
                        if first is None:
                            first, first_rows = last, len(batch[0])
            conn.send(("ok", count, rows, nbytes, first_rows, first, last))
        except Exception as exc:  # reported to the parent, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Clients:
    """``n`` client processes that read concurrently on request."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(child,), name=f"bench-client-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def read(self, server: ServerProcess, world: int, epochs: int) -> Round:
        """Clients 0…world-1 read ``epochs`` epochs each, all at once. The Round counts every
        window received after the very first batch of any client, over the time from that batch
        to the last batch of any client."""
        cpu0 = process_cpu_seconds(server.pid)
        for rank in range(world):
            self.conns[rank].send((server.host, server.port, rank, world, epochs))
        replies = []
        for rank in range(world):
            if not self.conns[rank].poll(10 * TIMEOUT_S):
                raise TimeoutError(f"client {rank} of {world}: no report within {10 * TIMEOUT_S:.0f}s")
            replies.append(self.conns[rank].recv())
        cpu1 = process_cpu_seconds(server.pid)
        errors = [r[1] for r in replies if r[0] != "ok"]
        if errors:
            raise RuntimeError(f"{len(errors)} of {world} clients failed: {errors[0]}")
        if sum(r[1] for r in replies) < 2:
            raise RuntimeError("fewer than two batches arrived: too little data to time")
        earliest = min(replies, key=lambda r: r[5])
        first, last = earliest[5], max(r[6] for r in replies)
        rows = sum(r[2] for r in replies) - earliest[4]
        nbytes = int(sum(r[3] for r in replies) * rows / (rows + earliest[4]))
        producer = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        return Round(sum(r[1] for r in replies), rows, nbytes, last - first, 0.0, producer)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)


def serve_argv(dataset: str, batch_size: int, decoded_mb: int) -> list[str]:
    return [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0", "--batch-size",
            str(batch_size), "--hwm", str(HWM), "--status-interval", "0", "--decoded-cache-mb", str(decoded_mb)]


def decoded_budget_mb(source: WindowSource) -> int:
    """Half the decoded train split: room for the blocks the clients read side by side, too
    little to keep the split, so every epoch decodes it again (sharing measured, not keeping)."""
    row = sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in source.column_specs(source.sources))
    return max(1, int(source.rows("train") * row / 2 / 2**20))


def _series(results: dict[str, list[Round]], xs: tuple[int, ...], name: Any) -> dict[str, Any]:
    wps = {str(x): [r.rows / r.seconds for r in results[name(x)]] for x in xs}
    stats = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v} for k, v in wps.items()}
    return {"x": list(xs), "windows/s": stats,
            "speedup_at_max": stats[str(xs[-1])]["median"] / stats[str(xs[0])]["median"]}


def _clients_name(n: int) -> str:
    return f"{n} client{'s' if n > 1 else ''}"


def _unshared_name(n: int) -> str:
    return f"{_clients_name(n)}, unshared"


def _batch_name(b: int) -> str:
    return f"batch {b}"


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False) -> dict[str, Any]:
    from benchmarks import plots

    env = environment()
    size = sizes(quick)
    epochs = epochs_per_round(quick)
    dataset = str(ensure_dataset(data_dir, size["recordings"], size["seconds"]))
    probe = WindowSource(dataset)
    windows, budget = probe.rows("train"), decoded_budget_mb(probe)
    probe.close()
    wps = Metric("windows/s", lambda r: r.rows / r.seconds, "{:,.0f}")
    cpu = server_cpu_ms_per_window()
    describe = lambda r: f"{wps.of(r):,.0f} windows/s"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        progress(f"starting {max(CLIENTS)} client processes ...")
        clients = Clients(max(CLIENTS))
        stack.callback(clients.close)
        bs = size["batch_size"]
        shared = stack.enter_context(ServerProcess("fuelline serve", serve_argv(dataset, bs, budget),
                                                   Path(logs) / "clients.log"))
        unshared = stack.enter_context(ServerProcess("fuelline serve, unshared", serve_argv(dataset, bs, 0),
                                                     Path(logs) / "unshared.log"))
        by_clients = alternate(
            [c for n in CLIENTS for c in (Contender(_clients_name(n), lambda n=n: clients.read(shared, n, epochs)),
                                          Contender(_unshared_name(n), lambda n=n: clients.read(unshared, n, epochs)))],
            rounds, describe)
        exits = {f"server, batch {bs}": shared.stop(), f"server, batch {bs}, unshared": unshared.stop()}
        servers = {b: stack.enter_context(ServerProcess(f"batch {b}", serve_argv(dataset, b, budget), Path(logs) / f"b{b}.log"))
                   for b in batch_sizes(quick)}
        by_batch = alternate([Contender(_batch_name(b), lambda s=s: clients.read(s, 1, epochs)) for b, s in servers.items()],
                             rounds, describe)
        exits.update({f"server, batch {b}": s.stop() for b, s in servers.items()})
    clients_part = _series(by_clients, CLIENTS, _clients_name)
    unshared_part = _series(by_clients, CLIENTS, _unshared_name)
    batch_part = _series(by_batch, batch_sizes(quick), _batch_name)
    parameters = {"rounds": rounds, "quick": quick, **size, "train_windows": windows, "clients": list(CLIENTS),
                  "batch_sizes": list(batch_sizes(quick)), "epochs_per_round": epochs, "hwm": HWM, "dataset": dataset,
                  "decoded_cache_mb": budget}
    notes = [
        f"{rounds} timed rounds after a warm-up pass of each, contenders alternately; each round {epochs} epochs of "
        f"the train split ({windows} windows an epoch), shared among the clients by rank (rank r of world size N); "
        "each client reads its share of every epoch through one ServerDataStream.",
        "Clients are spawned processes, one server process (read-ahead threads, --workers 0) per series; on this "
        "machine clients and server share the same cores, so more clients compete for them.",
        "Aggregate windows/s: every window received after the first batch of any client, over the time from that "
        "batch to the last batch of any client (one monotonic clock for all client processes).",
        "Every client's share draws rows from every block (8 recordings). Shared: the server's decoded units "
        f"(--decoded-cache-mb {budget}, half the decoded split, so each epoch decodes it again) let the N ranks "
        "decode each recording once an epoch. Unshared (--decoded-cache-mb 0): each rank's reader decodes every "
        "block its share touches, up to N times the work.",
        f"{CLIENTS[-1]} clients deliver {clients_part['speedup_at_max']:.2f}× the windows/s of one shared, "
        f"{unshared_part['speedup_at_max']:.2f}× unshared; batch "
        f"{batch_sizes(quick)[-1]} delivers {batch_part['speedup_at_max']:.2f}× batch {batch_sizes(quick)[0]}.",
    ]
    record, md = build_report(
        "scaling", f"scaling — aggregate windows/s by clients (batch {size['batch_size']}) and by batch size (1 client)",
        {**by_clients, **by_batch}, [wps, cpu], [], parameters, notes, env, exits=exits,
        extra={"clients": clients_part, "clients_unshared": unshared_part, "batch_size": batch_part, "reference_windows_per_s": REFERENCE_WINDOWS_PER_S},
    )
    print(md, flush=True)
    for path in write_results("scaling", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.scaling(record, results_dir)}", flush=True)
    return record
