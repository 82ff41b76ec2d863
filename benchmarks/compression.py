"""Compression: gradient bytes per element and step time of none / fp16 / onebit at W = 2, from
the training benchmark (``benchmarks.trainer``: ``torchrun`` ranks on gloo reading from one
``fuelline serve``).

It reuses ``trainer.json`` in the results directory when that holds all three configurations
(the trainer benchmark of the same run, or an earlier one: its date is quoted), and otherwise
runs the trainer benchmark for just these three.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import trainer
from benchmarks.common import RESULTS_DIR, progress
from benchmarks.report import environment

__all__ = ["run"]

CONFIGS = ("none", "fp16", "onebit")
TARGET_OF_FP32 = 0.033  # 1/32 plus block scales


def _load(results_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((results_dir / "trainer.json").read_text())
    except (OSError, ValueError):
        return None
    if not all(record.get("runs", {}).get(name) for name in CONFIGS):
        return None
    return record


def _config(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per round, the median over the epochs after the first (onebit's warm-up is in the first);
    then the median and range over rounds."""
    def per_round(key: str) -> list[float]:
        out = []
        for epochs in runs:
            values = [e[key] for e in (epochs[1:] or epochs) if e.get(key) is not None]
            if values:
                out.append(statistics.median(values))
        return out

    step = [1e3 * v for v in per_round("step_time_s")]
    bpe = per_round("grad_bytes_per_element")
    acc = [epochs[-1]["val_accuracy"] for epochs in runs]
    bpe_median = statistics.median(bpe) if bpe else None
    return {
        "grad_bytes_per_element": bpe_median,
        "of_fp32_ring": None if bpe_median is None else bpe_median / trainer.FP32_RING,
        "step_time_ms": {"median": statistics.median(step), "min": min(step), "max": max(step), "values": step},
        "final_accuracy": {"median": statistics.median(acc), "min": min(acc), "max": max(acc), "values": acc},
        "rounds": len(runs),
    }


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False) -> dict[str, Any]:
    from benchmarks import plots

    env = environment()
    source = _load(results_dir)
    if source is None:
        progress("compression: no trainer.json with none/fp16/onebit here; running the trainer benchmark for them")
        trainer.run(rounds, data_dir, results_dir, quick=quick, configs=CONFIGS)
        source = _load(results_dir)
        if source is None:
            raise RuntimeError(f"the trainer benchmark left no usable {results_dir / 'trainer.json'} (see trainer.md)")
    configs = {name: _config(source["runs"][name]) for name in CONFIGS}
    none_acc = configs["none"]["final_accuracy"]["median"]
    onebit = configs["onebit"]
    record = {
        "benchmark": "compression", "title": f"compression — gradients at W = {trainer.WORLD} (gloo, CPU)", **env,
        "configs": configs, "fp32_ring_bytes_per_element": trainer.FP32_RING, "target_of_fp32": TARGET_OF_FP32,
        "onebit_meets_target": onebit["of_fp32_ring"] is not None and onebit["of_fp32_ring"] <= TARGET_OF_FP32,
        "onebit_accuracy_minus_none": onebit["final_accuracy"]["median"] - none_acc,
        "from_trainer": {"date": source.get("date"), "epochs": source.get("epochs"), "quick": source.get("quick", False),
                         "recordings": source.get("recordings"), "rounds": source.get("rounds")},
    }
    rows = ["| configuration | bytes/element | of fp32 ring | step time ms (median) | min–max | final accuracy |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, c in configs.items():
        bpe = "—" if c["grad_bytes_per_element"] is None else f"{c['grad_bytes_per_element']:.4f}"
        of = "—" if c["of_fp32_ring"] is None else f"{c['of_fp32_ring']:.2%}"
        s = c["step_time_ms"]
        rows.append(f"| {name} | {bpe} | {of} | {s['median']:.1f} | {s['min']:.1f}–{s['max']:.1f} | "
                    f"{c['final_accuracy']['median']:.3f} |")
    verdict = "meets" if record["onebit_meets_target"] else "misses"
    md = "\n".join([
        f"## {record['title']}", "", *rows, "",
        f"- onebit sends {onebit['of_fp32_ring'] or 0:.2%} of an fp32 ring all-reduce's bytes per element "
        f"(target ≤ {TARGET_OF_FP32:.1%}: {verdict}); its final accuracy is "
        f"{record['onebit_accuracy_minus_none']:+.3f} from uncompressed (momentum SGD against Adam: see trainer.md "
        "for like-for-like optimiser pairs).",
        f"- From the trainer benchmark of {source.get('date')}: {source.get('epochs')} epochs, "
        f"{source.get('recordings', trainer.RECORDINGS)} recordings, {len(source['runs']['none'])} round(s)"
        + (" — a quick run: a check that it works, not a measurement." if source.get("quick") else "."),
        "- Bytes per element: what each rank hands to collectives per gradient element in the epochs after the "
        f"first; fp32 ring all-reduce: {trainer.FP32_RING:.1f} bytes at W = {trainer.WORLD}. Step time: median over "
        "those epochs per round, then median and range over rounds.",
        "",
    ])
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "compression.json").write_text(json.dumps(record, indent=2) + "\n")
    (results_dir / "compression.md").write_text(md)
    print(md, flush=True)
    print(f"wrote {plots.compression(record, results_dir)}", flush=True)
    return record
