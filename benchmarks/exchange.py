"""Exchange: the 1-bit compressed exchange against an fp32 all-reduce, on gloo ranks.

``python -m benchmarks exchange [--before REV] [--rounds R]`` measures, in one run and in
alternating rounds (one round: ``W`` new rank processes of one revision):

* ``exchange``: averaging one vector of ``N`` elements with ``dist.all_reduce`` (fp32, what DDP
  does uncompressed) and with ``onebit_allreduce`` once compressing (send and reduce error
  feedback, the 1-bit Adam exchange); the median over repetitions that alternate the two inside
  each process;
* ``step``: a training step of an MLP of about 4.3 M parameters (batch 64), DDP with
  ``torch.optim.Adam`` against DDP with 1-bit Adam past its freeze step, alternating steps;
* with ``--before REV``, the same as commit REV does them (its own tree on ``PYTHONPATH``), on
  loopback.

Ranks talk over loopback, or over the links of a bed (``benchmarks.bed``: one network namespace
per rank, a rate-limited veth link each) with ``--links 1gbit,10gbit``; the bed needs root.
Every rank gets ``--threads`` intra-op threads (default 1): on a host of 2 cores, W = 4 already
shares them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import RESULTS_DIR, ROOT, SourceTree, progress
from benchmarks.report import environment

__all__ = ["run", "main"]

SIZES = (1_130_000, 4_300_000, 25_000_000)
WORLDS = (2, 4)
STEP_PARAMS = 4_300_000
REPS = 12
LAUNCH_TIMEOUT_S = 600


# -- one rank ----------------------------------------------------------------------------------------
def _mlp(params: int) -> Any:
    """An MLP 1024 -> h -> h -> 10 with about ``params`` parameters."""
    from torch import nn

    d_in, d_out = 1024, 10
    # h^2 + (d_in + d_out + 2) h ≈ params
    b = d_in + d_out + 2
    h = int((-b + (b * b + 4 * params) ** 0.5) / 2)
    return nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d_out))


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def _exchange_times(elements: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from fuelline.trainer.onebit import OneBitState, fp32_allreduce, onebit_allreduce

    rank = dist.get_rank()
    x = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
    y = torch.empty_like(x)
    state = OneBitState(warmup_iters=2)
    fp32, onebit = [], []
    for rep in range(reps + 2):  # the first two fill caches and error buffers
        dist.barrier()
        y.copy_(x)
        t0 = time.perf_counter()
        fp32_allreduce(state, y).wait()
        t1 = time.perf_counter()
        dist.barrier()
        y.copy_(x)
        t2 = time.perf_counter()
        onebit_allreduce(state, y, key="bench").wait()
        t3 = time.perf_counter()
        if rep >= 2:
            fp32.append(t1 - t0)
            onebit.append(t3 - t2)
    return {"fp32_ms": _median_ms(fp32), "onebit_ms": _median_ms(onebit)}


def _step_times(params: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fuelline.trainer.onebit_adam import OneBitAdam, register_onebit_adam

    rank = dist.get_rank()
    torch.manual_seed(0)
    plain, compressed = DDP(_mlp(params)), DDP(_mlp(params))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    state = register_onebit_adam(compressed)
    warm = 3
    onebit_opt = OneBitAdam(compressed.parameters(), lr=1e-4, freeze_step=warm, state=state)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 1024, generator=gen)
    target = torch.randint(0, 10, (64,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(model: Any, opt: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), target).backward()
        opt.step()
        return time.perf_counter() - t0

    none_s, onebit_s = [], []
    for rep in range(reps + warm + 1):
        a = step(plain, plain_opt)
        b = step(compressed, onebit_opt)
        if rep > warm:
            none_s.append(a)
            onebit_s.append(b)
    n = sum(p.numel() for p in plain.parameters())
    return {"params": n, "none_ms": _median_ms(none_s), "onebit_ms": _median_ms(onebit_s)}


def rank_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exchange --rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0's store")
    parser.add_argument("--what", choices=("exchange", "step"), required=True)
    parser.add_argument("--elements", type=int, default=SIZES[0])
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=120))
    result = (_exchange_times if args.what == "exchange" else _step_times)(args.elements, args.reps)
    # DDP and its hook's state sit in reference cycles: freed after the group is destroyed, they
    # abort the process ("terminate called without an active exception"), as the trainer's
    # lifecycle knows. Free them, meet, and tear the group down only once every rank is done.
    gc.collect()
    dist.barrier()
    if args.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


# -- the driver --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(what: str, world: int, elements: int, reps: int, threads: int, pythonpath: str | None,
           bed: Any = None) -> dict[str, float]:
    """One round: ``world`` rank processes (in the bed's hosts when given), rank 0's result."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if bed is None:
        master = f"127.0.0.1:{_free_port()}"
    else:
        master = f"{bed.hosts[0].address}:29511"
    procs = []
    with tempfile.TemporaryDirectory(prefix="fuelline-exchange-") as tmp:
        for rank in range(world):
            argv = [sys.executable, "-m", "benchmarks.exchange", "--rank", str(rank), "--world", str(world),
                    "--master", master, "--what", what, "--elements", str(elements), "--reps", str(reps),
                    "--threads", str(threads)]
            if bed is not None:
                argv = bed.hosts[rank].command(argv)
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            procs.append((subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        try:
            for proc, _ in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        outputs = []
        for _proc, log in procs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    failed = [(i, p.returncode) for i, (p, _) in enumerate(procs) if p.returncode]
    if failed:
        rank, rc = failed[0]
        raise RuntimeError(f"{what} W={world}: rank {rank} exited {rc}:\n{outputs[rank][-3000:]}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{what} W={world}: rank 0 printed no result:\n{outputs[0][-3000:]}")


def _summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run(rounds: int = 3, before: str | None = None, sizes: Sequence[int] = SIZES, worlds: Sequence[int] = WORLDS,
        step_params: int = STEP_PARAMS, reps: int = REPS, threads: int = 1, links: Sequence[str] = (),
        results_dir: Path = RESULTS_DIR, name: str = "exchange") -> dict[str, Any]:
    """Measure, write ``<name>.json`` and ``<name>.md``, return the record."""
    revisions: list[tuple[str, str | None]] = [("after", None)]  # (revision, its PYTHONPATH)
    cases: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if before is not None:
            tree = stack.enter_context(SourceTree(before, Path(stack.enter_context(tempfile.TemporaryDirectory()))))
            revisions.append(("before", tree.pythonpath))
        networks: list[tuple[str, Any]] = [("loopback", None)]
        for rate in links:
            networks.append((rate, rate))
        for network, rate in networks:
            # Before and after on loopback, where the exchange's own cost shows; after alone on links.
            present = revisions if rate is None else revisions[:1]
            for world in worlds:
                jobs = [("exchange", n) for n in sizes] + [("step", step_params)]
                for what, elements in jobs:
                    per: dict[str, list[dict[str, float]]] = {revision: [] for revision, _ in present}
                    for r in range(rounds):
                        for revision, path in (present if r % 2 == 0 else present[::-1]):
                            with ExitStack() as hosts:
                                net = None if rate is None else hosts.enter_context(_bed(world, rate))
                                result = launch(what, world, elements, reps, threads, path, net)
                            per[revision].append(result)
                            progress(f"exchange {network} W={world} {what} {elements:,} {revision}: {result}")
                    cases.append(_case(network, world, what, elements, per))
    record = {"benchmark": "exchange", "environment": environment(), "rounds": rounds, "reps": reps,
              "threads_per_rank": threads, "before": before, "cases": cases}
    write(record, results_dir, name)
    return record


def _bed(world: int, rate: str) -> Any:
    from benchmarks.bed import Bed

    return Bed(world, rate=rate)


def _case(network: str, world: int, what: str, elements: int, per: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    first, second = ("fp32_ms", "onebit_ms") if what == "exchange" else ("none_ms", "onebit_ms")
    case: dict[str, Any] = {"network": network, "world": world, "what": what, "elements": elements}
    for name, results in per.items():
        if what == "step":
            case["params"] = results[0]["params"]
        ratios = [r[second] / r[first] for r in results]
        case[name] = {"uncompressed_ms": _summary([r[first] for r in results]),
                      "onebit_ms": _summary([r[second] for r in results]),
                      "onebit_over_uncompressed": _summary(ratios)}
    if "before" in per:
        case["onebit_after_over_before"] = _summary(
            [a["onebit_ms"] / b["onebit_ms"] for a, b in zip(per["after"], per["before"])])
    return case


def _markdown(record: dict[str, Any]) -> str:
    before = record["before"]
    lines = ["## exchange — 1-bit exchange against fp32 all-reduce (gloo, CPU)", ""]
    head = "| network | W | what | elements | uncompressed ms | onebit ms | onebit / uncompressed |"
    sep = "|---|---:|---|---:|---:|---:|---:|"
    if before:
        head += f" onebit ms at {before} | after / before |"
        sep += "---:|---:|"
    lines += [head, sep]
    for c in record["cases"]:
        a = c["after"]
        what = "exchange" if c["what"] == "exchange" else "Adam step"
        n = c.get("params", c["elements"])
        row = (f"| {c['network']} | {c['world']} | {what} | {n:,} | {a['uncompressed_ms']['median']:.2f} | "
               f"{a['onebit_ms']['median']:.2f} | {a['onebit_over_uncompressed']['median']:.2f} "
               f"({a['onebit_over_uncompressed']['min']:.2f}–{a['onebit_over_uncompressed']['max']:.2f}) |")
        if before and "before" in c:
            r = c["onebit_after_over_before"]
            row += f" {c['before']['onebit_ms']['median']:.2f} | {r['median']:.3f} ({r['min']:.3f}–{r['max']:.3f}) |"
        lines.append(row)
    env = record["environment"]
    lines += ["", f"- {record['rounds']} rounds, revisions alternating; per round the median of {record['reps']} "
              f"repetitions inside the ranks, which alternate uncompressed and onebit; table: median over rounds "
              f"(range). {record['threads_per_rank']} intra-op thread(s) per rank; "
              f"{env['machine']['cpu_count']} CPUs on the host, so W > CPUs shares them; load average at start "
              f"{env['machine']['loadavg_at_start']}.",
              "- exchange: `dist.all_reduce` of fp32 vs `onebit_allreduce` once warm (send and reduce error "
              "feedback). Adam step: DDP + torch.optim.Adam vs DDP + 1-bit Adam past its freeze step, "
              "forward, backward and optimizer step of an MLP, batch 64.",
              "- network: loopback, or a bed (`benchmarks/bed.py`) of one network namespace per rank on a "
              "bridge, each link rate-limited with tc tbf."]
    return "\n".join(lines) + "\n"


def write(record: dict[str, Any], results_dir: Path = RESULTS_DIR, name: str = "exchange") -> list[Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = [results_dir / f"{name}.json", results_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(record, indent=2) + "\n")
    paths[1].write_text(_markdown(record))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--rank" in argv:
        return rank_main(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exchange", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", metavar="REV")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="elements exchanged, comma-separated")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--step-params", type=int, default=STEP_PARAMS)
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--links", default="", help="also on bed links of these rates, e.g. 1gbit,10gbit (root)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="exchange", help="results file name (default exchange: .json, .md)")
    args = parser.parse_args(argv)
    links = [r for r in args.links.split(",") if r]
    if links:
        # Refused now, not after the loopback rounds have run.
        from benchmarks.bed import check_rate, unavailable

        why = unavailable()
        if why:
            parser.error(f"--links: {why}")
        for rate in links:
            try:
                check_rate(rate)
            except ValueError as exc:
                parser.error(f"--links: {exc}")
    run(args.rounds, args.before, [int(s) for s in args.sizes.split(",")], [int(w) for w in args.worlds.split(",")],
        args.step_params, args.reps, args.threads, links, args.results_dir,
        args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
