"""Training with compressed gradients: bytes per element, step time and final accuracy for
none / fp16 / onebit (1-bit momentum SGD, and 1-bit Adam) at world size 2 on gloo, and fear
recall with and without the class weights, all on the same synth data, epochs and seed.

Each configuration is one ``torchrun --nproc_per_node 2 -m fuelline.trainer`` against one data
server; configurations take turns over the rounds, so the machine's noise falls on all of them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, ServerProcess, progress
from benchmarks.report import environment
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.multimodal.manifest import FORMAT

__all__ = ["run"]

RECORDINGS, SECONDS, SEED = 96, 30.0, 0
EPOCHS = 6
WORLD = 2
FP32_RING = 2 * (WORLD - 1) / WORLD * 4  # bytes per element an fp32 ring all-reduce sends

CONFIGS = {
    "none": ["--compression", "none", "--optimizer", "adam"],
    "fp16": ["--compression", "fp16", "--optimizer", "adam"],
    # 1-bit momentum SGD: the optimizer compresses its per-rank momentum's update, not the gradients.
    "onebit": ["--compression", "onebit", "--optimizer", "sgd", "--lr", "0.02"],
    "none (sgd)": ["--compression", "none", "--optimizer", "sgd", "--lr", "0.02"],
    # 1-bit Adam (also --optimizer onebit-adam).
    "onebit-adam": ["--compression", "onebit", "--optimizer", "adam", "--freeze-step", "60"],
    "none, no class weights": ["--compression", "none", "--optimizer", "adam", "--no-class-weights"],
}


# The quick run trains the three configurations the compression benchmark reads, so that benchmark
# reuses them: each is a torchrun launch of its own (about 6 s on 2 cores).
QUICK = {"recordings": 10, "seconds": 40.0, "epochs": 2, "rounds": 1, "configs": ("none", "fp16", "onebit")}


def ensure_dataset(data_dir: Path, recordings: int = RECORDINGS, seconds: float = SECONDS, seed: int = SEED) -> Path:
    """The synth data set of ``recordings`` × ``seconds`` drawn with ``seed``, made once in ``data_dir``."""
    data = data_dir / f"trainer-v2-{recordings}rec-{int(seconds)}s-seed{seed}-{FORMAT.replace('/', '-')}"
    if not data.is_dir():
        raw = data_dir / f"{data.name}-raw"
        if not raw.is_dir():
            synthesize(str(raw), recordings, seconds, seed)
        convert(str(raw), str(data), progress=False)
    return data


def train_once(endpoint: str, options: list[str], out: Path, epochs: int = EPOCHS, world: int = WORLD,
               seed: int = SEED) -> list[dict[str, Any]]:
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "fuelline.trainer", "--servers", endpoint, "--epochs", str(epochs), "--seed", str(seed),
           "--metrics-json", str(metrics), *options]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "Error" in line][:6]
        raise RuntimeError(f"training {options} failed:\n" + "\n".join(errors) + f"\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def summarise(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    last = [r[-1] for r in runs]
    warm = [e for r in runs for e in r[1:]]  # after the first epoch: the compressed regime
    bpe = [e["grad_bytes_per_element"] for e in warm if e["grad_bytes_per_element"] is not None]
    fear = [r["val_recall"].get("fear") for r in last if r["val_recall"].get("fear") is not None]
    return {
        "grad_bytes_per_element": statistics.median(bpe) if bpe else None,
        "of_fp32_ring": statistics.median(bpe) / FP32_RING if bpe else None,
        "step_time_s": statistics.median(e["step_time_s"] for e in warm),
        "samples_per_s": statistics.median(e["samples_per_s"] for e in warm),
        "final_accuracy": statistics.median(r["val_accuracy"] for r in last),
        "final_macro_f1": statistics.median(r["val_macro_f1"] for r in last),
        "final_fear_recall": statistics.median(fear) if fear else None,
        "rounds": len(runs),
        "per_round_final": [{k: r[k] for k in ("val_accuracy", "val_macro_f1", "val_recall")} for r in last],
    }


def run(rounds: int, data_dir: Path, results_dir: Path = RESULTS_DIR, quick: bool = False,
        configs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``quick``: a tiny run (QUICK: few recordings, 2 epochs, one round, none, fp16 and onebit) that
    shows the benchmark works, not how fast anything is. ``configs``: a subset of CONFIGS."""
    env = environment()
    recordings, seconds, epochs = (QUICK["recordings"], QUICK["seconds"], QUICK["epochs"]) if quick else (RECORDINGS, SECONDS, EPOCHS)
    if quick:
        rounds = QUICK["rounds"]
    chosen = {name: CONFIGS[name] for name in (configs or (QUICK["configs"] if quick else CONFIGS))}
    if quick:  # few steps: let onebit compress after the fewest plain steps it accepts, so its path runs
        chosen = {name: [*options, "--warmup-iters", "2"] if "onebit" in options else options
                  for name, options in chosen.items()}
    data = ensure_dataset(data_dir, recordings, seconds)
    results: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in chosen}
    failures: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-", dir=data_dir) as work, ExitStack() as stack:
        argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(data), "--port", "0", "--batch-size", "32"]
        server = stack.enter_context(ServerProcess("server", argv, Path(work) / "serve.log"))
        endpoint = f"{server.host}:{server.port}"
        for i in range(rounds):
            for name, options in chosen.items():
                out = Path(work) / f"{i}-{name.replace(' ', '_').replace(',', '')}"
                out.mkdir()
                try:
                    per_epoch = train_once(endpoint, options, out, epochs)
                except RuntimeError as exc:  # a failed run is a finding: recorded, and the others go on
                    failures.setdefault(name, []).append(str(exc)[-2000:])
                    progress(f"round {i + 1}/{rounds} {name}: FAILED ({str(exc).splitlines()[-1][:200]})")
                    continue
                results[name].append(per_epoch)
                e = per_epoch[-1]
                progress(f"round {i + 1}/{rounds} {name}: acc {e['val_accuracy']:.3f}, macro-F1 {e['val_macro_f1']:.3f}, "
                         f"{e['grad_bytes_per_element']} B/elem, step {e['step_time_s'] * 1e3:.1f} ms")
    summary = {name: summarise(runs) for name, runs in results.items() if runs}
    rows = ["| configuration | bytes/element | of fp32 ring | step time (ms) | samples/s | final accuracy | final macro-F1 | fear recall |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v, f: "—" if v is None else f.format(v)  # noqa: E731
    for name, s in summary.items():
        rows.append(f"| {name} | {fmt(s['grad_bytes_per_element'], '{:.4f}')} | {fmt(s['of_fp32_ring'], '{:.2%}')} | "
                    f"{s['step_time_s'] * 1e3:.1f} | {s['samples_per_s']:,.0f} | {s['final_accuracy']:.3f} | "
                    f"{s['final_macro_f1']:.3f} | {fmt(s['final_fear_recall'], '{:.2f}')} |")
    md = "\n".join([
        f"## trainer — {epochs} epochs, W = {WORLD} (gloo, CPU), {recordings} synth recordings × {seconds:.0f} s"
        + (" (quick: a check that it runs, not a measurement)" if quick else ""), "",
        *rows, "",
        f"Medians over {rounds} rounds (configurations alternate). Bytes per element are what each rank hands to "
        "collectives after the first epoch (onebit's warm-up of plain all-reduce is in the first), against an fp32 "
        f"ring all-reduce's {FP32_RING:.1f} bytes at W = {WORLD}. Accuracy, macro-F1 and fear recall are of the fused "
        "head on the val split (whole recordings held out at convert time) after the last epoch.",
        f"- {env['date']}; {env['machine']['cpu_count']} CPUs; python {env['versions']['python']}.",
        *(f"- {name}: {len(errs)} of {rounds} runs FAILED (see trainer.json)." for name, errs in failures.items()),
    ])
    record = {"benchmark": "trainer", **env, "configs": chosen, "epochs": epochs, "world_size": WORLD,
              "recordings": recordings, "seconds": seconds, "quick": quick, "rounds": rounds,
              "summary": summary, "runs": results, "failures": failures}
    print(md, flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "trainer.json").write_text(json.dumps(record, indent=1, default=str))
    (results_dir / "trainer.md").write_text(md + "\n")
    return record
