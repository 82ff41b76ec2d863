"""``python -m benchmarks.simulation``: the protocol at scale, on a simulated network and clock.

    python -m benchmarks.simulation                     # 5 seeds of 16 ranks x 4 servers, with faults
    python -m benchmarks.simulation --soak              # 200 seeds, and 64 x 8 with faults
    python -m benchmarks.simulation --ranks 1000 --servers 100 --seeds 1
    python -m benchmarks.simulation --storm --ranks 1000 --servers 100
                                                        # every server restarted at once, with and
                                                        # without jitter: writes results/simulation.md

Exits 1 if any run broke an invariant (each is printed with its seed: the same seed breaks it again).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from benchmarks.common import RESULTS_DIR
from benchmarks.simulation import Config, Outcome, Storm, run, storm


def _print(o: Outcome, to_the_end: bool = True) -> None:
    """One run's line; ``to_the_end``: the job was run to its end (a storm stops once every link reads again)."""
    rate = o.simulated / o.wall if o.wall else float("inf")
    ok = o.ok if to_the_end else not o.violations
    print(f"seed {o.seed:4d}: {'ok  ' if ok else 'FAIL'} {o.cfg.ranks} ranks x {o.cfg.servers} servers, "
          f"{o.finished} ranks finished, {o.simulated:.1f} simulated s in {o.wall:.1f} s ({rate:.1f}x), "
          f"{o.events} events, {o.hellos} Hellos, {o.reconnects} reconnects", flush=True)
    if not ok:
        for fault in o.faults:
            print(f"      fault: {fault}")
        for violation in o.violations[:10]:
            print(f"      {violation}")


def _storm_table(cfg: Config, rows: list[tuple[float, str, Storm]], at: float, args: str) -> str:
    lines = [
        "# A reconnect storm: every server restarted at once",
        "",
        f"`python -m benchmarks.simulation {args}`: {cfg.ranks} ranks reading from {cfg.servers} servers "
        f"(every rank from every server: {cfg.ranks * cfg.servers} connections), heartbeat {cfg.heartbeat} s, "
        f"hwm {cfg.hwm}, a step of {cfg.step} s a rank; every server killed at {at:.1f} s and started again "
        "some seconds later. Simulated time and network (`benchmarks.simulation`: libzmq queues what a socket "
        "sends while its server is down, and connects again every 100 ms), real protocol state machines "
        "(`ServingCore`, `Link`). A server's CPU: 0.3 ms a Hello, 20 us a request, 40 us a batch, 2 us a session "
        "a turn.",
        "",
        "| down | backoff | peak Hellos per server per s (100 ms) | busiest second | Hellos per server after | "
        "every link reads again after | median link | invariants | wall s | simulated s per wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for down, name, s in rows:
        o = s.outcome
        lines.append(
            f"| {down:g} s | {name} | {s.peak_hellos_per_s:.0f} | {s.peak_hellos_1s} | {s.hellos_per_server:.0f} | "
            f"{s.time_to_read_again:.2f} s | {s.median_to_read_again:.2f} s | "
            f"{'held' if not o.violations else f'{len(o.violations)} broken'} | {o.wall:.0f} | {o.simulated / o.wall:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.simulation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None, help="per rank, server and epoch")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--soak", action="store_true", help="200 seeds at the given size, then 20 of 64 ranks x 8 servers")
    parser.add_argument("--storm", action="store_true", help="every server restarted at once, with and without jitter")
    parser.add_argument("--down", type=float, nargs="+", default=[2.0, 10.0, 25.0],
                        help="--storm: seconds the servers stay down (one storm each)")
    parser.add_argument("--heartbeat", type=float, default=None, help="the servers' and clients' interval")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    cfg = Config(ranks=args.ranks, servers=args.servers)
    if args.epochs is not None:
        cfg = replace(cfg, epochs=args.epochs)
    if args.batches is not None:
        cfg = replace(cfg, batches=args.batches)
    if args.heartbeat is not None:
        cfg = replace(cfg, heartbeat=args.heartbeat)
    if args.storm:
        # A fast trainer (a step of 10 ms), and batches enough that no link runs out before its
        # server is back: every link has some to read after the restart.
        at = 3.0
        step = 0.01
        per_link = (at + max(args.down) + 5.0) / (cfg.servers * step) + cfg.hwm + 2
        cfg = replace(cfg, step=step, liars=0, epochs=args.epochs or 1, batches=args.batches or int(per_link))
        rows = []
        for down in args.down:
            for name, jitter in (("jittered (default)", True), ("without jitter", False)):
                s = storm(replace(cfg, jitter=jitter), args.first_seed, at, down)
                _print(s.outcome, to_the_end=False)
                rows.append((down, name, s))
        table = _storm_table(cfg, rows, at, " ".join(sys.argv[1:]) if argv is None else " ".join(argv))
        print(table)
        out = RESULTS_DIR.__class__(args.results_dir) / "simulation.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
        print(f"wrote {out}")
        return 0 if not any(s.outcome.violations for _, _, s in rows) else 1
    plan = [(cfg, range(args.first_seed, args.first_seed + (200 if args.soak else args.seeds)))]
    if args.soak:
        plan.append((replace(cfg, ranks=64, servers=8), range(20)))
    failed = 0
    start = time.perf_counter()
    for c, seeds in plan:
        for seed in seeds:
            o = run(c, seed, faults=not args.no_faults)
            _print(o)
            failed += not o.ok
    print(f"{failed} of {sum(len(s) for _, s in plan)} runs broke an invariant; {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
