"""Convergence with and without 1-bit compression: val accuracy and train loss per epoch, for
momentum SGD and Adam, at world sizes 2 and 4, over several seeds.

``python -m benchmarks.convergence [--epochs 15] [--seeds 0 1 2] [--worlds 2 4]``

Seed ``s`` is both the trainer's ``--seed`` and the seed the synth data set is drawn with, so
every seed is another model initialisation on other data. Per seed one data server serves its
data set; per world size and optimizer, the uncompressed and the compressed run go one after
the other, so the machine's noise falls on both. Writes ``convergence.json``, ``convergence.md``
(final accuracy per configuration, mean and per seed; mean accuracy per epoch) and
``convergence.png`` (curves, mean with the range over seeds) to the results directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, ServerProcess, progress
from benchmarks.report import environment
from benchmarks.trainer import RECORDINGS, SECONDS, ensure_dataset, train_once
from fuelline.trainer.cli import refusal

__all__ = ["CONFIGS", "main", "markdown", "plot", "run"]

EPOCHS, SEEDS, WORLDS = 15, (0, 1, 2), (2, 4)
# Per optimizer, its usual learning rate, uncompressed and with 1-bit compression (the defaults
# otherwise: 10 warm-up steps for SGD, the variance frozen at step 100 for Adam).
CONFIGS = {
    "sgd": ["--optimizer", "sgd", "--lr", "0.02"],
    "adam": ["--optimizer", "adam", "--lr", "1e-3"],
}
COMPRESSIONS = ("none", "onebit")
LAST = 3  # epochs averaged for the steadier "last epochs" figure
QUICK = {"recordings": 10, "seconds": 40.0, "epochs": 2, "seeds": (0,), "worlds": (2,)}


def _name(world: int, optimizer: str, compression: str) -> str:
    return f"W={world} {optimizer} {compression}"


def _summarise(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Figures of one configuration over its seeds (``runs``: seed -> per-epoch records)."""
    finals = {seed: r[-1]["val_accuracy"] for seed, r in runs.items()}
    lasts = {seed: statistics.mean(e["val_accuracy"] for e in r[-LAST:]) for seed, r in runs.items()}
    epochs = min(len(r) for r in runs.values())
    per_epoch = {key: [[r[i][key] for r in runs.values()] for i in range(epochs)]
                 for key in ("val_accuracy", "train_loss")}
    warm = [e for r in runs.values() for e in r[1:]] or [e for r in runs.values() for e in r]
    bpe = [e["grad_bytes_per_element"] for e in warm if e["grad_bytes_per_element"] is not None]
    return {
        "final_accuracy": statistics.mean(finals.values()),
        "final_accuracy_per_seed": finals,
        "last_epochs_accuracy": statistics.mean(lasts.values()),
        "final_train_loss": statistics.mean(r[-1]["train_loss"] for r in runs.values()),
        "per_epoch": {key: {"mean": [statistics.mean(v) for v in values], "min": [min(v) for v in values],
                            "max": [max(v) for v in values]} for key, values in per_epoch.items()},
        "grad_bytes_per_element": statistics.median(bpe) if bpe else None,
        "step_time_s": statistics.median(e["step_time_s"] for e in warm),
        "compressed": runs[next(iter(runs))][-1].get("compressed"),
    }


def _table(record: dict[str, Any]) -> list[str]:
    summary, seeds = record["summary"], record["seeds"]
    rows = [("| W | optimizer | compression | final val accuracy (mean) | per seed " + " / ".join(map(str, seeds))
             + f" | Δ vs none | last {LAST} epochs (mean) | Δ | bytes/element | step (ms) |"),
            "|---:|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for world in record["worlds"]:
        for optimizer in CONFIGS:
            base = summary.get(_name(world, optimizer, "none"))
            for compression in COMPRESSIONS:
                s = summary.get(_name(world, optimizer, compression))
                if s is None:
                    rows.append(f"| {world} | {optimizer} | {compression} | FAILED | | | | | | |")
                    continue
                finals = s["final_accuracy_per_seed"]
                per_seed = " / ".join(f"{finals[str(x)]:.3f}" if str(x) in finals else "—" for x in seeds)
                delta = "" if base is None or compression == "none" else f"{100 * (s['final_accuracy'] - base['final_accuracy']):+.1f} pt"
                delta_last = ("" if base is None or compression == "none"
                              else f"{100 * (s['last_epochs_accuracy'] - base['last_epochs_accuracy']):+.1f} pt")
                bpe = s["grad_bytes_per_element"]
                what = f" ({s['compressed']})" if s.get("compressed") else ""
                if refusal(optimizer, compression, int(world)):
                    what += ", refused by the trainer"
                rows.append(f"| {world} | {optimizer} | {compression}{what} | {s['final_accuracy']:.3f} | {per_seed} | "
                            f"{delta} | {s['last_epochs_accuracy']:.3f} | {delta_last} | "
                            f"{'—' if bpe is None else f'{bpe:.4f}'} | {s['step_time_s'] * 1e3:.0f} |")
    return rows


def _epoch_table(record: dict[str, Any]) -> list[str]:
    summary = record["summary"]
    epochs = max((len(s["per_epoch"]["val_accuracy"]["mean"]) for s in summary.values()), default=0)
    rows = [("| configuration | " + " | ".join(str(i + 1) for i in range(epochs)) + " |"),
            ("|---|" + "---:|" * epochs)]
    for name, s in summary.items():
        acc = s["per_epoch"]["val_accuracy"]["mean"]
        rows.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
    return rows


def markdown(record: dict[str, Any]) -> str:
    """The tables of a record: final accuracy per configuration, and mean accuracy per epoch."""
    quick = " (quick: a check that it runs, not a measurement)" if record["quick"] else ""
    env = record["environment"]
    return "\n".join([
        (f"## convergence — {record['epochs']} epochs, {record['recordings']} synth recordings × "
         f"{record['seconds']:.0f} s, seeds {', '.join(map(str, record['seeds']))} (gloo, CPU){quick}"), "",
        *_table(record), "",
        ("Seed s seeds both the model and the synth data set. Accuracy is the fused head's on the val split (whole "
         f"recordings held out). The last-{LAST}-epochs figure averages the val accuracy of the last {LAST} epochs "
         "per seed, steadier than the last epoch alone. Bytes per element are what each rank hands to collectives "
         "per element of the exchanged vector after the first epoch (median); an fp32 ring all-reduce sends 4 at "
         "W = 2 and 6 at W = 4. onebit exchanges the optimizer's momentum (1-bit momentum SGD, 1-bit Adam). "
         "A row marked refused is a combination the trainer refuses without --accept-accuracy-loss, because of "
         "what this table shows."), "",
        "Mean val accuracy per epoch:", "",
        *_epoch_table(record), "",
        f"- {env['date']}; {env['machine']['cpu_count']} CPUs; python {env['versions']['python']}.",
        *(f"- {name}: FAILED for seed {seed}." for name, seeds in record["failures"].items() for seed in seeds),
    ])


def plot(record: dict[str, Any], results_dir: Path) -> Path:
    """Val accuracy (top) and train loss (bottom) per epoch, one column per world size and
    optimizer, uncompressed and 1-bit: the mean over seeds with their range shaded."""
    from benchmarks.plots import FUELLINE_COLOR, OTHER_COLOR, _save, plt

    columns = [(w, o) for w in record["worlds"] for o in CONFIGS]
    fig, axes = plt.subplots(2, len(columns), figsize=(3.6 * len(columns), 6.4), squeeze=False)
    for col, (world, optimizer) in enumerate(columns):
        for row, (key, label) in enumerate((("val_accuracy", "val accuracy"), ("train_loss", "train loss"))):
            ax = axes[row][col]
            for compression, color in (("none", OTHER_COLOR), ("onebit", FUELLINE_COLOR)):
                s = record["summary"].get(_name(world, optimizer, compression))
                if s is None:
                    continue
                curve = s["per_epoch"][key]
                x = range(1, len(curve["mean"]) + 1)
                ax.plot(x, curve["mean"], color=color, marker=".", label=compression)
                ax.fill_between(x, curve["min"], curve["max"], color=color, alpha=0.2)
            ax.set_xlabel("epoch")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.set_ylabel(label + " (mean, range)")
            if row == 0:
                ax.set_title(f"W = {world}, {optimizer}", fontsize=10)
                ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"convergence over seeds {', '.join(map(str, record['seeds']))}: uncompressed (grey) and 1-bit "
                 "(blue)", fontsize=10)
    return _save(fig, results_dir / "convergence.png")


def run(data_dir: Path, results_dir: Path = RESULTS_DIR, epochs: int = EPOCHS, seeds: Sequence[int] = SEEDS,
        worlds: Sequence[int] = WORLDS, quick: bool = False) -> dict[str, Any]:
    """Train every configuration on every seed; write the record, tables and plot.

    ``quick``: a tiny run (QUICK) that shows the benchmark works, not how anything converges.
    """
    env = environment()
    recordings, seconds = RECORDINGS, SECONDS
    if quick:
        recordings, seconds, epochs, seeds, worlds = (QUICK[k] for k in ("recordings", "seconds", "epochs", "seeds",
                                                                          "worlds"))
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    failures: dict[str, list[int]] = {}
    for seed in seeds:
        data = ensure_dataset(data_dir, recordings, seconds, seed=seed)
        with tempfile.TemporaryDirectory(prefix="fuelline-conv-", dir=data_dir) as work, ExitStack() as stack:
            argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(data), "--port", "0",
                    "--batch-size", "32"]
            server = stack.enter_context(ServerProcess("server", argv, Path(work) / "serve.log"))
            endpoint = f"{server.host}:{server.port}"
            for world in worlds:
                for optimizer, options in CONFIGS.items():
                    for compression in COMPRESSIONS:
                        name = _name(world, optimizer, compression)
                        out = Path(work) / name.replace(" ", "_").replace("=", "")
                        out.mkdir()
                        # A combination the trainer refuses is measured all the same (that is why it is refused).
                        extra = ["--compression", compression, "--accept-accuracy-loss"]
                        if quick and compression == "onebit":  # few steps: compress after the fewest plain ones
                            extra += ["--warmup-iters", "2", "--freeze-step", "2"]
                        try:
                            per_epoch = train_once(endpoint, [*options, *extra], out, epochs, world=world, seed=seed)
                        except RuntimeError as exc:  # a failed run is a finding: recorded, the others go on
                            failures.setdefault(name, []).append(seed)
                            progress(f"seed {seed} {name}: FAILED ({str(exc).splitlines()[-1][:200]})")
                            continue
                        runs.setdefault(name, {})[seed] = per_epoch
                        e = per_epoch[-1]
                        progress(f"seed {seed} {name}: acc {e['val_accuracy']:.3f}, loss {e['train_loss']:.3f}, "
                                 f"{e['grad_bytes_per_element']:.4f} B/elem, step {e['step_time_s'] * 1e3:.0f} ms")
    record = {"benchmark": "convergence", "environment": env, "configs": CONFIGS, "epochs": epochs,
              "seeds": list(seeds), "worlds": list(worlds), "recordings": recordings, "seconds": seconds,
              "quick": quick, "summary": {name: _summarise(r) for name, r in runs.items()},
              "runs": {name: {str(s): r for s, r in per_seed.items()} for name, per_seed in runs.items()},
              "failures": failures}
    record = json.loads(json.dumps(record, default=str))  # as it will be read back: seeds as strings
    md = markdown(record)
    print(md, flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "convergence.json").write_text(json.dumps(record, indent=1))
    (results_dir / "convergence.md").write_text(md + "\n")
    plot(record, results_dir)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs per run (default {EPOCHS})")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="model and data seeds (default 0 1 2)")
    p.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="world sizes (default 2 4)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the data sets are made and reused")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where convergence.* are written")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one seed: checks that the benchmark works")
    args = p.parse_args(argv)
    if args.epochs < 1 or any(w < 1 for w in args.worlds):
        p.error("--epochs and --worlds must be >= 1")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    run(args.data_dir, args.results_dir, args.epochs, args.seeds, args.worlds, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
