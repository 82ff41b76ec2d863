"""``fuelline convert`` in 1, 2 and 4 parts, run side by side as separate processes on this host.

    python -m benchmarks.convert_parts [--recordings 64 --seconds 60 --rounds 5] [--quick]

Raw recordings from ``fuelline synth`` (64 recordings of 60 s: about 205 MB of TSV). Each round runs,
in turn (the order reversed every other round): a one-part ``fuelline convert RAW DATASET``, and for
N = 1, 2, 4 the N ``--part I/N`` processes at once, then ``--finish N``. Per part: its TSV bytes
(from its part.json) over its process's wall time, start-up included. In total: the raw folder's
TSV bytes over the wall time from the first part's start to the finish's end, and over the parts'
time alone. Medians and ranges over the rounds, after one untimed warm-up round. Writes
benchmarks/results/convert-parts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, progress

PARTS = (1, 2, 4)
TIMEOUT = 600
ZSCORED = "4z"  # 4 parts that write their own z-scored grids before the finish
OPTIONS: list[str] = []  # (the shard size, set by main)


def _fuelline(*args: str) -> list[str]:
    return [sys.executable, "-m", "fuelline.server.cli", *args]


def _tsv_bytes(raw: Path) -> int:
    return sum(p.stat().st_size for p in raw.rglob("*.tsv"))


def _check(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate(timeout=TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {err.strip()[-2000:]}")


def one_part(raw: Path, work: Path) -> dict[str, Any]:
    out = work / "one"
    start = time.perf_counter()
    _check(subprocess.Popen(_fuelline("convert", str(raw), str(out), *OPTIONS), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True), "fuelline convert")
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return {"seconds": seconds}


def zscore_share(raw: Path, work: Path) -> dict[str, Any]:
    """A one-part conversion in this process, then its z-scored grids written again from its
    grids with its statistics: the work a finish does that the parts do not divide."""
    from fuelline.server.ingest.convert import convert
    from fuelline.server.multimodal.grid import write_zscored
    from fuelline.server.multimodal.manifest import NEAREST

    out = work / "in-process"
    start = time.perf_counter()
    manifest = convert(str(raw), str(out), recordings_per_shard=int(OPTIONS[1]), progress=False)
    seconds = time.perf_counter() - start
    grids = sorted({(p.grid_file, p.zgrid_file, m) for r in manifest.recordings for m, p in r.modalities.items()})
    start = time.perf_counter()
    for grid, zgrid, m in grids:
        write_zscored(str(out / grid), str(out / f"{zgrid}.again"), manifest.stats[m], m in NEAREST)
    zscore_seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return {"seconds": zscore_seconds, "convert_seconds": seconds}


def side_by_side(commands: list[list[str]], what: str) -> tuple[list[float], float]:
    """Commands run at once: the seconds to each one's end, and to the last one's."""
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    n = len(procs)
    ended: dict[int, float] = {}
    errors: dict[int, str] = {}

    def wait(i: int, p: subprocess.Popen) -> None:
        try:
            _check(p, f"{what} {i}/{n}")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            errors[i] = str(exc)
        ended[i] = time.perf_counter() - start

    waiters = [threading.Thread(target=wait, args=(i, p)) for i, p in enumerate(procs)]
    try:
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(TIMEOUT + 10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if errors or len(ended) < n:
        raise RuntimeError(f"{n} × {what}: {errors or 'one did not end'}")
    return [ended[i] for i in range(n)], time.perf_counter() - start


def in_parts(raw: Path, work: Path, n: int, zscore: bool = False) -> dict[str, Any]:
    """N parts side by side (with ``zscore``, then N ``--zscore-part`` side by side), then the
    finish: wall times and each part's TSV bytes."""
    out = work / f"parts-{n}"
    part_seconds, parts_seconds = side_by_side(
        [_fuelline("convert", str(raw), str(out), "--part", f"{i}/{n}", *OPTIONS) for i in range(n)], "--part")
    zscore_seconds = 0.0
    if zscore:
        _, zscore_seconds = side_by_side(
            [_fuelline("convert", str(raw), str(out), "--zscore-part", f"{i}/{n}", *OPTIONS) for i in range(n)],
            "--zscore-part")
    part_bytes = []
    for i in range(n):
        with open(out.parent / f"parts-{n}.parts" / f"part-{i}-of-{n}" / "part.json") as f:
            part_bytes.append(json.load(f)["signal_bytes"])
    finish_start = time.perf_counter()
    _check(subprocess.Popen(_fuelline("convert", str(raw), str(out), "--finish", str(n), *OPTIONS), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True), f"--finish {n}")
    finish_seconds = time.perf_counter() - finish_start
    shutil.rmtree(out)
    return {"part_seconds": part_seconds, "part_bytes": part_bytes, "parts_seconds": parts_seconds,
            "zscore_seconds": zscore_seconds, "finish_seconds": finish_seconds,
            "seconds": parts_seconds + zscore_seconds + finish_seconds}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rounds: list[dict[str, Any]], tsv: int) -> dict[str, Any]:
    mb = tsv / 1e6
    out: dict[str, Any] = {"one-part convert": {"total_mb_s": _spread([mb / r["one"]["seconds"] for r in rounds]),
                                                "seconds": _spread([r["one"]["seconds"] for r in rounds])}}
    shares = [r["share"]["seconds"] / r["share"]["convert_seconds"] for r in rounds]
    out["z-scored grids in a one-part conversion"] = {
        "share": _spread(shares), "seconds": _spread([r["share"]["seconds"] for r in rounds]),
        "convert_seconds": _spread([r["share"]["convert_seconds"] for r in rounds])}
    for name in [*map(str, PARTS), ZSCORED]:
        runs = [r[name] for r in rounds]
        per_part = [b / 1e6 / s for run in runs for b, s in zip(run["part_bytes"], run["part_seconds"])]
        out[f"{name} parts"] = {
            "per_part_mb_s": _spread(per_part),
            "total_mb_s": _spread([mb / run["seconds"] for run in runs]),
            "parts_only_mb_s": _spread([mb / run["parts_seconds"] for run in runs]),
            "parts_seconds": _spread([run["parts_seconds"] for run in runs]),
            "zscore_seconds": _spread([run["zscore_seconds"] for run in runs]),
            "finish_seconds": _spread([run["finish_seconds"] for run in runs]),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    def cell(s: dict[str, float], digits: int = 1) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"

    lines = [
        "# fuelline convert in parts",
        "",
        f"`python -m benchmarks.convert_parts` on {result['host']['cpus']} CPUs ({result['host']['machine']}): "
        f"{result['raw']['recordings']} synthetic recordings of {result['raw']['seconds']:g} s, "
        f"{result['raw']['tsv_bytes'] / 1e6:.1f} MB of TSV; parts run side by side as separate processes on this "
        f"one host, {result['rounds']} rounds after a warm-up, contenders in turn. Median (min–max) over the rounds; "
        "per part: its TSV over its process's wall time; total: all the TSV over the wall time from the parts' "
        "start to the finish's end.",
        "",
        "| run | MB/s per part | MB/s total | MB/s, parts alone | parts s | `--zscore-part` s | finish s |",
        "|---|---|---|---|---|---|---|",
    ]
    one = result["results"]["one-part convert"]
    lines.append(f"| `fuelline convert` (no parts) | — | {cell(one['total_mb_s'])} | — | {cell(one['seconds'], 2)} "
                 "| — | — |")
    for name in [*map(str, PARTS), ZSCORED]:
        n = int(name.rstrip("z"))
        r = result["results"][f"{name} parts"]
        label = (f"{n} part{'s' if n > 1 else ''} (`--part I/{n}`, " + (f"`--zscore-part I/{n}`, " if name == ZSCORED else "")
                 + f"`--finish {n}`)")
        zs = cell(r["zscore_seconds"], 2) if name == ZSCORED else "—"
        lines.append(f"| {label} | {cell(r['per_part_mb_s'])} | {cell(r['total_mb_s'])} | {cell(r['parts_only_mb_s'])} "
                     f"| {cell(r['parts_seconds'], 2)} | {zs} | {cell(r['finish_seconds'], 2)} |")
    z = result["results"]["z-scored grids in a one-part conversion"]
    lines += ["", f"Writing every z-scored grid, the one step of a conversion that needs every part's statistics, "
                  f"took {cell(z['seconds'], 2)} s against {cell(z['convert_seconds'], 2)} s for a whole one-part "
                  f"conversion in one process: a share of {z['share']['median']:.0%} "
                  f"({z['share']['min']:.0%}–{z['share']['max']:.0%}).", "", result["note"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recordings", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--recordings-per-shard", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="8 recordings of 10 s in shards of 2, 1 round (a check that it runs)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.recordings, args.seconds, args.rounds, args.recordings_per_shard = 8, 10.0, 1, 2
    OPTIONS[:] = ["--recordings-per-shard", str(args.recordings_per_shard)]
    raw = args.data_dir / f"convert-parts-raw-{args.recordings}x{args.seconds:g}"
    if not (raw / "recordings.tsv").exists():
        shutil.rmtree(raw, ignore_errors=True)
        raw.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(_fuelline("synth", str(raw), "--recordings", str(args.recordings), "--seconds",
                                 str(args.seconds), "--seed", "1"), check=True, capture_output=True, timeout=TIMEOUT)
    tsv = _tsv_bytes(raw)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.data_dir, prefix="convert-parts-") as tmp:
        work = Path(tmp)
        for i in range(args.rounds + 1):  # round 0: the warm-up
            order: list[str] = ["one", *map(str, PARTS), ZSCORED, "share"]
            if i % 2:
                order.reverse()
            done: dict[str, Any] = {}
            for name in order:
                done[name] = (one_part(raw, work) if name == "one" else zscore_share(raw, work) if name == "share" else
                              in_parts(raw, work, int(name.rstrip("z")), zscore=name == ZSCORED))
                seconds = done[name]["seconds"]
                progress(f"{'warm-up' if i == 0 else f'round {i}/{args.rounds}'} {name}: {seconds:.2f}s "
                         f"({tsv / 1e6 / seconds:.1f} MB/s)")
            if i:
                rounds.append(done)
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "raw": {"recordings": args.recordings, "seconds": args.seconds, "tsv_bytes": tsv,
                "recordings_per_shard": args.recordings_per_shard},
        "rounds": args.rounds,
        "results": summarise(rounds, tsv),
        "runs": rounds,
        "note": "All parts here share this one host's cores and disk, so more parts than cores cannot add "
                "throughput; these figures are not a measurement across hosts. The finish (checks, statistics, "
                "links, every z-scored grid, the manifest) is the part of a conversion the parts do not divide.",
    }
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "convert-parts.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "convert-parts.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
