"""Device prefetch: how long a training step waits for its batch on the GPU, with and without
``ServerDataStream(device="cuda")``. Needs a CUDA GPU; on a host without one it says so and exits 2.

A Fuel-style stream of 4 MiB batches (float32 features [256, 4096] and int64 labels) is served by
``start_server`` in its own process. The consumer trains a small MLP on each batch and waits for
the step to finish (as a loop that logs its loss every step does), so the host-side wait for the
next batch is what the GPU would otherwise be idle for. Contenders, alternately, the same batches:

- ``.to(device)``: CPU tensors (``tensors=True``) moved in the loop, a synchronous copy per batch;
- ``device="cuda"``: the next batch copied on a side stream while the step runs;
- ``device="cuda", pin_memory=True``: the same, through reusable pinned host buffers.

Figures per round: the data wait per step (the time from the end of a step until the batch is
usable on the device; the first batch, which waits for the connection, left out), the batches delivered to the device in MB/s (batch bytes / round time), and
the share of batches copied ahead. Medians over the rounds. A copy test of the same batch size
gives the bare host-to-device MB/s from pageable and from pinned memory (CUDA events). It runs in
well under two minutes.

    python -m benchmarks.device_prefetch [--rounds 5] [--batches 150] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from benchmarks.common import RESULTS_DIR, ServerProcess, progress
from benchmarks.report import environment, write_results
from fuelline.client import ServerDataStream

__all__ = ["main", "run", "serve"]

ROWS, DIM, CLASSES = 256, 4096, 10
HWM = 8
HOST = "127.0.0.1"
TIMEOUT_S = 60.0
COPIES = 50  # host-to-device copies timed per kind of host memory

MOVE, DEVICE, PINNED = ".to(device)", "device='cuda'", "device='cuda', pin_memory=True"


class RepeatedBatches:
    """A Fuel-style stream of ``batches`` batches, the same arrays each time (no preprocessing)."""

    sources = ("features", "label")

    def __init__(self, batches: int) -> None:
        rng = np.random.default_rng(0)
        self.batches = batches
        self.features = rng.standard_normal((ROWS, DIM), dtype=np.float32)
        self.label = rng.integers(0, CLASSES, ROWS).astype(np.int64)

    def get_epoch_iterator(self, **kwargs: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for _ in range(self.batches):
            yield self.features, self.label


def serve(batches: int) -> None:
    """Entry point of the server process: serves until SIGTERM."""
    from fuelline.server import start_server

    start_server(RepeatedBatches(batches), port=0, hwm=HWM, host=HOST)


def refusal() -> str | None:
    """Why this host cannot run the benchmark, or None."""
    try:
        import torch
    except ImportError:
        return "device_prefetch needs torch with CUDA, and torch is not installed"
    if not torch.cuda.is_available():
        return (f"device_prefetch needs a CUDA GPU: torch.cuda.is_available() is False on this host "
                f"(torch {torch.__version__}); run it on a GPU host")
    return None


def _round(server: ServerProcess, name: str, batches: int, step: Callable[[Any, Any], Any]) -> dict[str, float]:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    options: dict[str, Any] = {"tensors": True} if name == MOVE else {"device": device, "pin_memory": name == PINNED}
    waits = []
    count = nbytes = 0
    started = time.perf_counter()
    with ServerDataStream(RepeatedBatches.sources, host=server.host, port=server.port, hwm=HWM, timeout=TIMEOUT_S,
                          receive_timeout=TIMEOUT_S, **options) as stream:
        batches_it = stream.get_epoch_iterator()
        while True:
            asked = time.perf_counter()
            batch = next(batches_it, None)
            if batch is None:
                break
            if name == MOVE:
                batch = tuple(t.to(device) for t in batch)
            waits.append(time.perf_counter() - asked)
            step(*batch)
            torch.cuda.current_stream(device).synchronize()  # the step ends (a loss logged every step)
            count += 1
            nbytes += sum(t.numel() * t.element_size() for t in batch)
        ahead = 0 if stream.placement is None else stream.placement.staged_ahead
    seconds = time.perf_counter() - started
    if count != batches:
        raise RuntimeError(f"{name}: {count} batches arrived, expected {batches}")
    waits = waits[1:]  # the first batch's wait is the connection's
    return {"seconds": seconds, "wait_ms_per_step": 1e3 * statistics.fmean(waits),
            "wait_ms_median": 1e3 * statistics.median(waits), "device_mb_s": nbytes / seconds / 1e6,
            "copied_ahead": ahead / count}


def _copy_mb_s(pinned: bool) -> float:
    """Bare host-to-device bandwidth for one batch's features, from pageable or pinned memory."""
    import torch

    host = torch.empty((ROWS, DIM), dtype=torch.float32, pin_memory=pinned)
    dev = torch.empty((ROWS, DIM), dtype=torch.float32, device="cuda")
    dev.copy_(host)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPIES):
        dev.copy_(host, non_blocking=pinned)
    end.record()
    end.synchronize()
    return COPIES * host.numel() * host.element_size() / (start.elapsed_time(end) / 1e3) / 1e6


def _trainer() -> Callable[[Any, Any], Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, CLASSES)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(features: Any, label: Any) -> Any:
        loss = torch.nn.functional.cross_entropy(model(features), label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return step


def run(rounds: int, batches: int, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Warm-up one round of each contender, then ``rounds`` rounds of each, alternately."""
    import torch

    step = _trainer()
    names = (MOVE, DEVICE, PINNED)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        code = f"from benchmarks.device_prefetch import serve; serve({batches!r})"
        server = stack.enter_context(ServerProcess("server", [sys.executable, "-c", code], Path(logs) / "serve.log"))
        for name in names:
            _round(server, name, batches, step)
        progress("warm-up done")
        for i in range(rounds):
            for name in names:
                r = _round(server, name, batches, step)
                results[name].append(r)
                progress(f"round {i + 1}/{rounds} {name}: wait {r['wait_ms_per_step']:.3f} ms/step, "
                         f"{r['device_mb_s']:.0f} MB/s, {r['copied_ahead']:.0%} copied ahead")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    copies = {"pageable_mb_s": _copy_mb_s(False), "pinned_mb_s": _copy_mb_s(True)}
    record = {
        "benchmark": "device_prefetch", "environment": environment(), "gpu": torch.cuda.get_device_name(),
        "parameters": {"rounds": rounds, "batches": batches, "rows": ROWS, "dim": DIM, "hwm": HWM},
        "medians": medians, "rounds": results, "host_to_device": copies,
        "wait_saved_ms_per_step": medians[MOVE]["wait_ms_per_step"] - medians[PINNED]["wait_ms_per_step"],
    }
    lines = [
        "# device_prefetch: data wait per training step, with and without device prefetch",
        "",
        f"{batches} batches of {ROWS}×{DIM} float32 + int64 labels ({ROWS * DIM * 4 / 2**20:.0f} MiB) per round on "
        f"{record['gpu']}; {rounds} rounds after a warm-up of each, contenders alternately; medians.",
        "",
        "| contender | data wait ms/step (mean) | (median step) | to the device MB/s | copied ahead |",
        "|---|---|---|---|---|",
        *(f"| {name} | {m['wait_ms_per_step']:.3f} | {m['wait_ms_median']:.3f} | {m['device_mb_s']:.0f} | "
          f"{m['copied_ahead']:.0%} |" for name, m in medians.items()),
        "",
        f"Bare host-to-device copies of one batch's features: {copies['pageable_mb_s']:.0f} MB/s from pageable "
        f"memory, {copies['pinned_mb_s']:.0f} MB/s from pinned memory.",
        "",
    ]
    markdown = "\n".join(lines)
    print(markdown, flush=True)
    for path in write_results("device_prefetch", record, markdown, results_dir):
        print(f"wrote {path}", flush=True)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_prefetch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    p.add_argument("--batches", type=int, default=150, help="batches per round (default 150)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where to write the results")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.batches < 2:
        p.error("--rounds must be >= 1 and --batches >= 2")
    why = refusal()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    run(args.rounds, args.batches, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
