"""Scaling: aggregate windows/s of one data server against the number of concurrent clients, and
of one client against the batch size.

Data: the pipeline benchmark's converted recordings (``benchmarks.pipeline``). Clients are
processes (spawned once, reused in every round): in a round with N clients, clients 0…N-1 each
read their rank's share (rank r of world size N) of one epoch at the same time from one
``fuelline serve`` process. Aggregate windows/s is the windows every client received after its
own first batch, over the time from the first client's first batch to the last client's last
batch (one machine's monotonic clock). Batch sizes: one ``fuelline serve --batch-size B`` process
per size, one client each, alternately.

Server and clients share this machine's cores, so the aggregate is as much the clients' CPU as
the server's. Every round also measures the clients' own CPU (all client processes together), the
whole machine's busy CPU (other processes included) and the units the server decoded (its
Prometheus counter), so the report can say what share of a drop with more clients is the
server's cost per window, the clients' own, and the cores they could get.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.clients import HWM, Clients
from benchmarks.common import RESULTS_DIR, Contender, Round, ServerProcess, alternate, progress
from benchmarks.pipeline import REFERENCE_WINDOWS_PER_S, ensure_dataset, sizes
from benchmarks.report import Metric, RatioSpec, build_report, environment, server_cpu_ms_per_window, write_results
from fuelline.server.multimodal.source import WindowSource

__all__ = ["run"]

CLIENTS = (1, 2, 4, 8)
KEPT_CLIENTS = (CLIENTS[0], CLIENTS[-1])  # the whole split kept decoded: the server's cost without re-decoding
PROCESSES = 2  # serving processes of the one server of the --processes contenders


def batch_sizes(quick: bool) -> tuple[int, ...]:
    return (8, 16, 32) if quick else (16, 64, 256)


def epochs_per_round(quick: bool) -> int:
    """Every client reads this many epochs of its share per round, so start-up does not dominate.

    An epoch of the train split is about 1,560 windows, 25 batches of 64 among all the clients:
    at 3 epochs a round lasted 0.1–0.2 s and 8 clients read about 9 batches each, and the
    round's start (8 handshakes, sessions, threads, slabs) was about a third of the server's CPU
    for 8 clients (about 95 ms a round against 48 ms an epoch, in reads of 1 to 8 epochs).
    Starting is measured on its own (``start_s`` of each round)."""
    return 2 if quick else 16


def serve_argv(dataset: str, batch_size: int, decoded_mb: int) -> list[str]:
    # (The metrics endpoint costs nothing between scrapes, and it is scraped outside the timed read.)
    return [sys.executable, "-m", "fuelline.server.cli", "serve", dataset, "--port", "0", "--batch-size",
            str(batch_size), "--hwm", str(HWM), "--status-interval", "0", "--decoded-cache-mb", str(decoded_mb),
            "--metrics-port", "0"]


def decoded_budget_mb(source: WindowSource) -> int:
    """Half the decoded train split: room for the blocks the clients read side by side, too
    little to keep the split, so every epoch decodes it again (sharing measured, not keeping)."""
    row = sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in source.column_specs(source.sources))
    return max(1, int(source.rows("train") * row / 2 / 2**20))


def _series(results: dict[str, list[Round]], xs: tuple[int, ...], name: Any) -> dict[str, Any]:
    def stats(of: Any) -> dict[str, dict[str, Any]]:
        values = {str(x): [of(r) for r in results[name(x)]] for x in xs}
        return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v} for k, v in values.items()}

    wps = stats(lambda r: r.rows / r.seconds)
    server = stats(lambda r: float("nan") if r.producer_cpu_s is None else 1e3 * r.producer_cpu_s / r.rows)
    return {"x": list(xs), "windows/s": wps, "server CPU ms/window": server,
            "speedup_at_max": wps[str(xs[-1])]["median"] / wps[str(xs[0])]["median"],
            "server_cpu_at_max": server[str(xs[-1])]["median"] / server[str(xs[0])]["median"]}


def round_metrics(extras: dict[int, dict[str, Any]]) -> list[Metric]:
    """The clients' CPU per window, the units the server decoded per epoch, how busy the
    machine's cores were (everyone's processes) over each read, and how long until every client
    had its first batch (asked at once, outside the timed span)."""
    def decoded(r: Round) -> float:
        e = extras[id(r)]
        return float("nan") if e["decoded"] is None else e["decoded"] / e["epochs"]

    def busy(r: Round) -> float:
        e = extras[id(r)]
        return 100.0 * e["machine_busy_s"] / (e["wall_s"] * e["cores"])

    return [Metric("clients' CPU ms/window", lambda r: 1e3 * r.consumer_cpu_s / r.rows, "{:.3f}"),
            Metric("units decoded/epoch", decoded, "{:.1f}"),
            Metric("machine CPU busy %", busy, "{:.0f}"),
            Metric("s to the last client's first batch", lambda r: extras[id(r)]["start_s"], "{:.3f}")]


def breakdown(results: dict[str, list[Round]], extras: dict[int, dict[str, Any]], one: str, many: str) -> dict[str, Any]:
    """Why ``many`` delivers what it does against ``one``, from the medians of their rounds.

    Over a whole read (connecting included, every window counted) on C shared cores, windows/s
    is exactly f·C / (s + c): s and c the server's and the clients' CPU seconds per window, f the
    share of the cores the two got (what idle time and other processes left them). So the ratio
    of those windows/s is the product of three factors: f_many/f_one (cores got),
    (s1+c1)/(s1+c_many) (the clients' own CPU per window, the server's kept at one client's) and
    (s1+c_many)/(s_many+c_many) (the server's CPU per window); a fourth, timing, is the headline
    ratio (timed from the first batch) over the whole-read one.
    """
    def med(name: str, f: Any) -> float:
        return statistics.median(f(r, extras[id(r)]) for r in results[name])

    s1, sn = (med(n, lambda r, e: (r.producer_cpu_s or 0.0) / e["all_rows"]) for n in (one, many))
    c1, cn = (med(n, lambda r, e: r.consumer_cpu_s / e["all_rows"]) for n in (one, many))
    f1, fn = (med(n, lambda r, e: (r.consumer_cpu_s + (r.producer_cpu_s or 0.0)) / (e["wall_s"] * e["cores"]))
              for n in (one, many))
    whole = med(many, lambda r, e: e["all_rows"] / e["wall_s"]) / med(one, lambda r, e: e["all_rows"] / e["wall_s"])
    measured = med(many, lambda r, e: r.rows / r.seconds) / med(one, lambda r, e: r.rows / r.seconds)
    factors = {"cores got": fn / f1, "clients' CPU/window": (s1 + c1) / (s1 + cn),
               "server CPU/window": (s1 + cn) / (sn + cn)}
    factors["timing"] = measured / math.prod(factors.values())
    return {"one": one, "many": many, "server_ms": [1e3 * s1, 1e3 * sn], "clients_ms": [1e3 * c1, 1e3 * cn],
            "cores_got": [f1, fn], "whole_read_ratio": whole, "measured": measured, "factors": factors}


def _breakdown_note(b: dict[str, Any]) -> str:
    cores, clients, server, timing = b["factors"].values()
    return (f"Why {b['many']} deliver {b['measured']:.2f}× the windows/s of {b['one']} (over whole reads, "
            f"every window and connecting counted: server CPU {b['server_ms'][0]:.3f} → {b['server_ms'][1]:.3f} "
            f"ms/window; the clients' own CPU {b['clients_ms'][0]:.3f} → {b['clients_ms'][1]:.3f} ms/window, all "
            f"client processes together; share of the cores the two got {b['cores_got'][0]:.0%} → "
            f"{b['cores_got'][1]:.0%}): {b['measured']:.2f} = {cores:.2f} (cores got) × {clients:.2f} (clients' "
            f"CPU/window) × {server:.2f} (server CPU/window) × {timing:.2f} (timed from the first batch, not the "
            "whole read).")


def _kept_note(results: dict[str, list[Round]], one: str, many: str, kept: tuple[str, str]) -> str:
    """The server's CPU per window with and without decoding again what the ranks share: the part
    of its growth that re-decoding is, and the part that more sessions are."""
    def med(name: str) -> float:
        return statistics.median(1e3 * (r.producer_cpu_s or 0.0) / r.rows for r in results[name])

    s1, sn, k1, kn = med(one), med(many), med(kept[0]), med(kept[1])
    return (f"Server CPU per window, {one} → {many}: {s1:.3f} → {sn:.3f} ms with the decoded units over budget, "
            f"{k1:.3f} → {kn:.3f} ms with the whole split kept decoded (nothing decoded twice). Of the growth, "
            f"{(sn - s1) - (kn - k1):+.3f} ms/window is decoding again what the ranks drifted apart on, and "
            f"{kn - k1:+.3f} ms/window comes with serving {many.split()[0]} sessions at once instead of one (all the "
            "rest: a producer thread each, per-rank gathers and batches, handshakes).")


def _split_note(results: dict[str, list[Round]], extras: dict[int, dict[str, Any]], name: str) -> str:
    """Each round of a --processes contender beside how its batches were split among the processes:
    the kernel spreads connections by a hash, so a round's figure depends on the split it drew."""
    rounds = [f"{r.rows / r.seconds:,.0f} ({'/'.join(f'{100 * x:.0f}' for x in extras[id(r)]['process_shares'] or [])} %)"
              for r in results[name]]
    return (f"{name}, each round's windows/s with the share of its batches each serving process sent, largest "
            f"first: {', '.join(rounds)}.")


def _clients_name(n: int) -> str:
    return f"{n} client{'s' if n > 1 else ''}"


def _unshared_name(n: int) -> str:
    return f"{_clients_name(n)}, unshared"


def _kept_name(n: int) -> str:
    return f"{_clients_name(n)}, split kept"


def _two_servers_name(n: int) -> str:
    return f"{_clients_name(n)}, 2 servers"


def _processes_name(n: int) -> str:
    return f"{_clients_name(n)}, --processes {PROCESSES}"


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
        # Room for the whole decoded split twice over: decoded once, then kept.
        kept = stack.enter_context(ServerProcess("fuelline serve, split kept", serve_argv(dataset, bs, 4 * budget),
                                                 Path(logs) / "kept.log"))
        contenders = [c for n in CLIENTS for c in (
            Contender(_clients_name(n), lambda n=n: clients.read(shared, n, epochs)),
            Contender(_unshared_name(n), lambda n=n: clients.read(unshared, n, epochs)))]
        contenders += [Contender(_kept_name(n), lambda n=n: clients.read(kept, n, epochs)) for n in KEPT_CLIENTS]
        # A second server like the first: every client reads from both (the host's other core).
        second = stack.enter_context(ServerProcess("fuelline serve, second", serve_argv(dataset, bs, budget),
                                                   Path(logs) / "second.log"))
        contenders += [Contender(_two_servers_name(n), lambda n=n: clients.read([shared, second], n, epochs))
                       for n in KEPT_CLIENTS]
        # One server of several serving processes on one port, each client served by one of them.
        several = stack.enter_context(ServerProcess(
            f"fuelline serve --processes {PROCESSES}", [*serve_argv(dataset, bs, budget), "--processes", str(PROCESSES)],
            Path(logs) / "processes.log"))
        contenders += [Contender(_processes_name(n), lambda n=n: clients.read(several, n, epochs)) for n in KEPT_CLIENTS]
        by_clients = alternate(contenders, rounds, describe)
        exits = {f"server, batch {bs}": shared.stop(), f"server, batch {bs}, unshared": unshared.stop(),
                 f"server, batch {bs}, split kept": kept.stop(), f"server, batch {bs}, second": second.stop(),
                 f"server, batch {bs}, --processes {PROCESSES}": several.stop()}
        servers = {b: stack.enter_context(ServerProcess(f"batch {b}", serve_argv(dataset, b, budget), Path(logs) / f"b{b}.log"))
                   for b in batch_sizes(quick)}
        by_batch = alternate([Contender(_batch_name(b), lambda s=s: clients.read(s, 1, epochs)) for b, s in servers.items()],
                             rounds, describe)
        exits.update({f"server, batch {b}": s.stop() for b, s in servers.items()})
    clients_part = _series(by_clients, CLIENTS, _clients_name)
    unshared_part = _series(by_clients, CLIENTS, _unshared_name)
    batch_part = _series(by_batch, batch_sizes(quick), _batch_name)
    why = breakdown(by_clients, clients.extras, _clients_name(CLIENTS[0]), _clients_name(CLIENTS[-1]))
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
        "batch to the last batch of any client (one monotonic clock for all client processes). Starting is "
        "measured apart: s to the last client's first batch is the time from asking every client of a round to "
        "read (each opens its ServerDataStream then) to the first batch of the last of them to get one.",
        "Every client's share draws rows from every block (8 recordings). Shared: the server's decoded units "
        f"(--decoded-cache-mb {budget}, half the decoded split, so each epoch decodes it again) let ranks that ask "
        "for a unit while it is kept or being decoded share one decode; units decoded/epoch (the server's "
        "counter) says how far that goes when the ranks drift apart. Unshared (--decoded-cache-mb 0): each rank's "
        "reader decodes every block its share touches, up to N times the work (not counted there: nan).",
        "CPU per window counts the whole read (connecting included) over the windows timed; clients' CPU is all "
        "client processes together; machine CPU busy is every process on the machine, other users' included, "
        "over the read.",
        f"{CLIENTS[-1]} clients deliver {clients_part['speedup_at_max']:.2f}× the windows/s of one shared, "
        f"{unshared_part['speedup_at_max']:.2f}× unshared; batch "
        f"{batch_sizes(quick)[-1]} delivers {batch_part['speedup_at_max']:.2f}× batch {batch_sizes(quick)[0]}. "
        f"The server's CPU per window, what it controls: {clients_part['server_cpu_at_max']:.2f}× one client's at "
        f"{CLIENTS[-1]} clients shared, {unshared_part['server_cpu_at_max']:.2f}× unshared.",
        _breakdown_note(why),
        _split_note(by_clients, clients.extras, _processes_name(CLIENTS[-1])),
        _kept_note(by_clients, _clients_name(CLIENTS[0]), _clients_name(CLIENTS[-1]),
                   (_kept_name(KEPT_CLIENTS[0]), _kept_name(KEPT_CLIENTS[-1]))),
        f"2 servers: a second fuelline serve process like the first (--decoded-cache-mb {budget}), and every "
        "client reads from both (ServerDataStream(endpoints=[both]): rank r of N reads ranks 2r and 2r+1 of 2N, "
        "one from each server, batch k from server k mod 2), so each server decodes every unit its ranks touch. "
        "A server prepares each session's batches on a thread of one process, and Python's interpreter lock "
        "keeps all of them near one core: the second process is what the host's other core can add. Not one "
        "server, so not the target's comparison; server CPU is both processes'.",
        f"--processes {PROCESSES}: one fuelline serve (--decoded-cache-mb {budget} in each process) whose "
        f"{PROCESSES} serving processes share its port; the kernel hands each connection to one of them, so each "
        "client is served whole by one process (spread by a hash of the connection, not balanced), which "
        "decodes every unit its clients touch. Server CPU is all its processes'.",
    ]
    many, one = _clients_name(CLIENTS[-1]), _clients_name(CLIENTS[0])
    two_many, two_one = _two_servers_name(CLIENTS[-1]), _two_servers_name(CLIENTS[0])
    proc_many, proc_one = _processes_name(CLIENTS[-1]), _processes_name(CLIENTS[0])
    ratios = [RatioSpec(many, one, target=1.0),
              RatioSpec(many, one, metric=cpu.unit, higher=False),
              RatioSpec(proc_many, proc_one, target=1.0), RatioSpec(proc_many, one), RatioSpec(proc_one, one),
              RatioSpec(two_many, one), RatioSpec(two_many, two_one), RatioSpec(two_one, one)]
    record, md = build_report(
        "scaling", f"scaling — aggregate windows/s by clients (batch {size['batch_size']}) and by batch size (1 client)",
        {**by_clients, **by_batch}, [wps, cpu, *round_metrics(clients.extras)], ratios, parameters, notes, env,
        exits=exits, extra={"clients": clients_part, "clients_unshared": unshared_part, "batch_size": batch_part,
                            "breakdown": why, "reference_windows_per_s": REFERENCE_WINDOWS_PER_S},
    )
    print(md, flush=True)
    for path in write_results("scaling", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.scaling(record, results_dir)}", flush=True)
    return record
