"""Convergence with and without 1-bit compression: val accuracy and train loss per epoch, for
momentum SGD and Adam, at world sizes 2 and 4, over several seeds, on two kinds of task.

``python -m benchmarks.convergence [--tasks synth,digits-mlp,digits-cnn] [--epochs 15]
[--digits-epochs 20] [--seeds 0 1 2] [--worlds 2 4]``

synth: the built-in model on synth data. Seed ``s`` is both the trainer's ``--seed`` and the seed
the synth data set is drawn with, so every seed is another model initialisation on other data.

digits-mlp, digits-cnn: a user's model on unnormalised data: scikit-learn's digits as shipped
(pixels 0..16, not z-scored; ``benchmarks/digits.py``), served by ``fuelline serve`` from a Parquet
data set written from it, and trained with ``--model benchmarks.digits:mlp`` or ``:cnn`` at the
learning rates a user would pick (SGD 0.05 with momentum 0.9, Adam 1e-3). The split is fixed; seed
``s`` is the trainer's and the server's ``--seed`` (initialisation and batch order). A run the
trainer stops as non-finite (exit 3) is recorded as diverged. Needs scikit-learn: without it
these tasks are skipped, with a line that says so.

Per seed one data server serves its data set; per world size and optimizer, the uncompressed and
the compressed run go one after the other, so the machine's noise falls on both. Writes
``convergence.json``, ``convergence.md`` (final accuracy per configuration, mean and per seed; the
bytes sent per element, per epoch and over the whole run; mean accuracy per epoch),
``convergence.png`` (synth curves, mean with the range over seeds) and ``convergence-digits.png``
to the results directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_DATA_DIR, RESULTS_DIR, ROOT, ServerProcess, progress
from benchmarks.report import environment
from benchmarks.trainer import RECORDINGS, SECONDS, ensure_dataset
from fuelline.trainer.cli import refusal

__all__ = ["CONFIGS", "DIGITS_CONFIGS", "TASKS", "main", "markdown", "plot", "plot_digits", "run", "train"]

EPOCHS, DIGITS_EPOCHS, SEEDS, WORLDS = 15, 20, (0, 1, 2), (2, 4)
# Per optimizer, its usual learning rate, uncompressed and with 1-bit compression (the trainer's
# warm-ups otherwise: auto, 15 % of the run's steps).
CONFIGS = {
    "sgd": ["--optimizer", "sgd", "--lr", "0.02"],
    "adam": ["--optimizer", "adam", "--lr", "1e-3"],
}
# What a user would pick for a small model of their own.
DIGITS_CONFIGS = {
    "sgd": ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"],
    "adam": ["--optimizer", "adam", "--lr", "1e-3"],
}
DIGITS_MODELS = {"digits-mlp": "benchmarks.digits:mlp", "digits-cnn": "benchmarks.digits:cnn"}
TASKS = ("synth", *DIGITS_MODELS)
COMPRESSIONS = ("none", "onebit")
LAST = 3  # epochs averaged for the steadier "last epochs" figure
BATCH = 32  # rows per batch and rank
QUICK = {"recordings": 10, "seconds": 40.0, "epochs": 2, "seeds": (0,), "worlds": (2,)}
NON_FINITE_EXIT = 3  # the trainer's exit status when it stops a run whose parameters went non-finite


def _name(world: int, optimizer: str, compression: str) -> str:
    return f"W={world} {optimizer} {compression}"


def _ring(world: int) -> float:
    """Bytes per element an fp32 ring all-reduce sends per rank."""
    return 2 * (world - 1) / world * 4


@dataclass(frozen=True)
class Outcome:
    """One training run: its per-epoch metrics, and the trainer's line if it stopped as non-finite."""

    epochs: list[dict[str, Any]]
    diverged: str | None = None


def train(endpoint: str, options: list[str], out: Path, epochs: int, world: int, seed: int) -> Outcome:
    """One ``torchrun -m fuelline.trainer`` run. Raises RuntimeError if it failed other than by
    going non-finite."""
    metrics = out.resolve() / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "fuelline.trainer", "--servers", endpoint, "--epochs", str(epochs), "--seed", str(seed),
           "--metrics-json", str(metrics), *options]
    env = dict(os.environ)  # the ranks import --model's module from this tree, wherever this runs from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    per_epoch = ([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                 if metrics.exists() else [])
    if result.returncode == 0:
        return Outcome(per_epoch)
    # torchrun itself exits 1 whatever its ranks did; its failure report gives each rank's status.
    if result.returncode == NON_FINITE_EXIT or re.search(rf"exitcode\s*:\s*{NON_FINITE_EXIT}\b", result.stderr):
        line = next((x for x in result.stderr.splitlines() if "finite" in x), f"exit {NON_FINITE_EXIT}")
        return Outcome(per_epoch, re.sub(r"^.*?rank \d+: ", "", line.strip())[:300])
    errors = [line for line in result.stderr.splitlines() if "Error" in line][:6]
    raise RuntimeError(f"training {options} failed:\n" + "\n".join(errors) + f"\n{result.stderr[-3000:]}")


@dataclass
class Results:
    """Runs of one task: per configuration name, per seed."""

    runs: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    failures: dict[str, list[int]] = field(default_factory=dict)
    diverged: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)

    def train(self, name: str, seed: int, endpoint: str, options: list[str], work: Path, epochs: int,
              world: int, label: str = "") -> None:
        out = Path(work) / f"{label}{name}".replace(" ", "_").replace("=", "")
        out.mkdir()
        try:
            outcome = train(endpoint, options, out, epochs, world=world, seed=seed)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a failed run is a finding: recorded, the others go on
            self.failures.setdefault(name, []).append(seed)
            progress(f"seed {seed} {label}{name}: FAILED ({str(exc).splitlines()[-1][:200]})")
            return
        if outcome.diverged is not None:
            self.diverged.setdefault(name, {})[seed] = {"message": outcome.diverged, "epochs_done": len(outcome.epochs)}
            progress(f"seed {seed} {label}{name}: DIVERGED after {len(outcome.epochs)} epochs ({outcome.diverged})")
            return
        self.runs.setdefault(name, {})[seed] = outcome.epochs
        e = outcome.epochs[-1]
        run_bpe = e.get("run_grad_bytes_per_element")
        progress(f"seed {seed} {label}{name}: acc {e['val_accuracy']:.3f}, loss {e['train_loss']:.3f}, "
                 f"{e['grad_bytes_per_element']:.4f} B/elem (whole run {_num(run_bpe, '{:.4f}')}), "
                 f"step {e['step_time_s'] * 1e3:.0f} ms")

    def record(self) -> dict[str, Any]:
        return {"summary": {name: _summarise(r) for name, r in self.runs.items()},
                "runs": {name: {str(s): r for s, r in per_seed.items()} for name, per_seed in self.runs.items()},
                "failures": self.failures,
                "diverged": {name: {str(s): d for s, d in per_seed.items()} for name, per_seed in self.diverged.items()}}


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _summarise(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Figures of one configuration over its finished seeds (``runs``: seed -> per-epoch records)."""
    finals = {seed: r[-1]["val_accuracy"] for seed, r in runs.items()}
    lasts = {seed: statistics.mean(e["val_accuracy"] for e in r[-LAST:]) for seed, r in runs.items()}
    epochs = min(len(r) for r in runs.values())
    per_epoch = {key: [[r[i][key] for r in runs.values()] for i in range(epochs)]
                 for key in ("val_accuracy", "train_loss")}
    warm = [e for r in runs.values() for e in r[1:]] or [e for r in runs.values() for e in r]
    bpe = [e["grad_bytes_per_element"] for e in warm if e["grad_bytes_per_element"] is not None]
    # The last epoch's whole-run figure: every byte sent, warm-up included, over every element.
    run_bpe = [r[-1]["run_grad_bytes_per_element"] for r in runs.values()
               if r[-1].get("run_grad_bytes_per_element") is not None]
    return {
        "final_accuracy": statistics.mean(finals.values()),
        "final_accuracy_min": min(finals.values()),
        "final_accuracy_max": max(finals.values()),
        "final_accuracy_per_seed": finals,
        "last_epochs_accuracy": statistics.mean(lasts.values()),
        "final_train_loss": statistics.mean(r[-1]["train_loss"] for r in runs.values()),
        "per_epoch": {key: {"mean": [statistics.mean(v) for v in values], "min": [min(v) for v in values],
                            "max": [max(v) for v in values]} for key, values in per_epoch.items()},
        "grad_bytes_per_element": statistics.median(bpe) if bpe else None,
        "run_grad_bytes_per_element": statistics.mean(run_bpe) if run_bpe else None,
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
                name = _name(world, optimizer, compression)
                s = summary.get(name)
                if s is None:
                    what = "DIVERGED" if name in record.get("diverged", {}) else "FAILED"
                    rows.append(f"| {world} | {optimizer} | {compression} | {what} | | | | | | |")
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


def _digits_table(record: dict[str, Any]) -> list[str]:
    digits, seeds = record["digits"], record["seeds"]
    rows = [("| model | W | optimizer | compression | final val accuracy: mean (range) | per seed "
             + " / ".join(map(str, seeds)) + " | Δ vs none | diverged | bytes/element per epoch | whole run "
             "| whole run, of fp32 ring | step (ms) |"),
            "|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for task, result in digits["tasks"].items():
        summary, diverged, failures = result["summary"], result["diverged"], result["failures"]
        for world in record["worlds"]:
            for optimizer in DIGITS_CONFIGS:
                base = summary.get(_name(world, optimizer, "none"))
                for compression in COMPRESSIONS:
                    name = _name(world, optimizer, compression)
                    s, gone, failed = summary.get(name), diverged.get(name, {}), failures.get(name, [])
                    what = f" ({s['compressed']})" if s and s.get("compressed") else ""
                    if refusal(optimizer, compression, int(world)):
                        what += ", refused by the trainer"
                    lead = f"| {task.removeprefix('digits-')} | {world} | {optimizer} | {compression}{what} |"
                    tried = len(s["final_accuracy_per_seed"]) if s else 0
                    tried += len(gone) + len(failed)
                    went = f"{len(gone)} of {tried}" + (f" (seed {', '.join(gone)})" if gone else "")
                    if failed:
                        went += f"; {len(failed)} FAILED"
                    if s is None:
                        rows.append(f"{lead} — | | | {went} | | | | |")
                        continue
                    finals = s["final_accuracy_per_seed"]
                    per_seed = " / ".join(f"{finals[str(x)]:.3f}" if str(x) in finals
                                          else ("diverged" if str(x) in gone else "—") for x in seeds)
                    delta = ("" if base is None or compression == "none"
                             else f"{100 * (s['final_accuracy'] - base['final_accuracy']):+.1f} pt")
                    run_bpe = s.get("run_grad_bytes_per_element")
                    rows.append(f"{lead} {s['final_accuracy']:.3f} ({s['final_accuracy_min']:.3f}–"
                                f"{s['final_accuracy_max']:.3f}) | {per_seed} | {delta} | {went} | "
                                f"{_num(s['grad_bytes_per_element'], '{:.4f}')} | {_num(run_bpe, '{:.4f}')} | "
                                f"{_num(None if run_bpe is None else run_bpe / _ring(int(world)), '{:.1%}')} | "
                                f"{s['step_time_s'] * 1e3:.0f} |")
    return rows


def _epoch_table(summaries: dict[str, dict[str, Any]]) -> list[str]:
    epochs = max((len(s["per_epoch"]["val_accuracy"]["mean"]) for s in summaries.values()), default=0)
    rows = [("| configuration | " + " | ".join(str(i + 1) for i in range(epochs)) + " |"),
            ("|---|" + "---:|" * epochs)]
    for name, s in summaries.items():
        acc = s["per_epoch"]["val_accuracy"]["mean"]
        rows.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
    return rows


def _notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """A line per failed or diverged run (``results``: prefix of the names -> a task's record)."""
    notes = [f"- {prefix}{name}: FAILED for seed {seed}." for prefix, r in results.items()
             for name, seeds in r["failures"].items() for seed in seeds]
    notes += [f"- {prefix}{name}: DIVERGED for seed {seed} after {d['epochs_done']} epochs: {d['message']}"
              for prefix, r in results.items() for name, per_seed in r.get("diverged", {}).items()
              for seed, d in per_seed.items()]
    return ["", *notes] if notes else []


def _synth_markdown(record: dict[str, Any], quick: str) -> list[str]:
    return [
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
        *_epoch_table(record["summary"]),
        *_notes({"": record}),
    ]


def _digits_markdown(record: dict[str, Any], quick: str) -> list[str]:
    digits = record["digits"]
    head = f"## convergence, a user's model on unnormalised data — scikit-learn digits{quick}"
    if digits.get("skipped"):
        return [head, "", f"Skipped: {digits['skipped']}"]
    scale = digits["scale"]
    pixels = "0..16 as shipped" if scale == 1 else f"0..16 divided by {scale:g}"
    return [
        head, "",
        (f"{digits['train_rows']:,} train / {digits['val_rows']} val images of 8 × 8 pixels ({pixels}, not z-scored), "
         f"{digits['epochs']} epochs, batches of {BATCH} per rank, seeds {', '.join(map(str, record['seeds']))} "
         "(gloo, CPU). Models: " + ", ".join(f"`--model {m}`" for t, m in DIGITS_MODELS.items() if t in digits["tasks"])
         + "; sgd: " + " ".join(DIGITS_CONFIGS["sgd"][2:]) + ", adam: " + " ".join(DIGITS_CONFIGS["adam"][2:])
         + ", 1-bit warm-ups the trainer's (auto)."), "",
        *_digits_table(record), "",
        ("Accuracy is the mean over the seeds whose run finished, with their range; a diverged run is one the "
         "trainer stopped because its parameters went non-finite (exit 3). Bytes per element per epoch: the median "
         "over the epochs after the first; whole run: everything each rank sent over the run, warm-up included, "
         "per element exchanged, against an fp32 ring all-reduce's 4 bytes at W = 2 and 6 at W = 4."), "",
        "Mean val accuracy per epoch:", "",
        *_epoch_table({f"{task.removeprefix('digits-')} {name}": s for task, result in digits["tasks"].items()
                       for name, s in result["summary"].items()}),
        *_notes({f"{task} ": result for task, result in digits["tasks"].items()}),
    ]


def markdown(record: dict[str, Any]) -> str:
    """The tables of a record, per task kind: final accuracy per configuration, mean accuracy per epoch."""
    quick = " (quick: a check that it runs, not a measurement)" if record["quick"] else ""
    env = record["environment"]
    parts: list[str] = []
    if "synth" in record.get("tasks", ["synth"]):
        parts += _synth_markdown(record, quick)
    if record.get("digits"):
        parts += [""] if parts else []
        parts += _digits_markdown(record, quick)
    return "\n".join([
        *parts, "",
        f"- {env['date']}; {env['machine']['cpu_count']} CPUs; python {env['versions']['python']}.",
    ])


def _curves(ax: Any, summary: dict[str, Any], world: int, optimizer: str, key: str) -> None:
    from benchmarks.plots import FUELLINE_COLOR, OTHER_COLOR

    for compression, color in (("none", OTHER_COLOR), ("onebit", FUELLINE_COLOR)):
        s = summary.get(_name(world, optimizer, compression))
        if s is None:
            continue
        curve = s["per_epoch"][key]
        x = range(1, len(curve["mean"]) + 1)
        ax.plot(x, curve["mean"], color=color, marker=".", label=compression)
        ax.fill_between(x, curve["min"], curve["max"], color=color, alpha=0.2)
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)


def plot(record: dict[str, Any], results_dir: Path) -> Path:
    """Val accuracy (top) and train loss (bottom) per epoch on synth, one column per world size and
    optimizer, uncompressed and 1-bit: the mean over seeds with their range shaded."""
    from benchmarks.plots import _save, plt

    columns = [(w, o) for w in record["worlds"] for o in CONFIGS]
    fig, axes = plt.subplots(2, len(columns), figsize=(3.6 * len(columns), 6.4), squeeze=False)
    for col, (world, optimizer) in enumerate(columns):
        for row, (key, label) in enumerate((("val_accuracy", "val accuracy"), ("train_loss", "train loss"))):
            ax = axes[row][col]
            _curves(ax, record["summary"], world, optimizer, key)
            ax.set_ylabel(label + " (mean, range)")
            if row == 0:
                ax.set_title(f"W = {world}, {optimizer}", fontsize=10)
                ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"convergence over seeds {', '.join(map(str, record['seeds']))}: uncompressed (grey) and 1-bit "
                 "(blue)", fontsize=10)
    return _save(fig, results_dir / "convergence.png")


def plot_digits(record: dict[str, Any], results_dir: Path) -> Path:
    """Val accuracy per epoch on digits, one row per model and one column per world size and
    optimizer, uncompressed and 1-bit: the mean over finished seeds with their range shaded."""
    from benchmarks.plots import _save, plt

    tasks = record["digits"]["tasks"]
    columns = [(w, o) for w in record["worlds"] for o in DIGITS_CONFIGS]
    fig, axes = plt.subplots(len(tasks), len(columns), figsize=(3.6 * len(columns), 3.2 * len(tasks)), squeeze=False)
    for row, (task, result) in enumerate(tasks.items()):
        for col, (world, optimizer) in enumerate(columns):
            ax = axes[row][col]
            _curves(ax, result["summary"], world, optimizer, "val_accuracy")
            ax.set_ylabel("val accuracy (mean, range)")
            ax.set_title(f"{task.removeprefix('digits-')}, W = {world}, {optimizer}", fontsize=10)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"digits (unnormalised) over seeds {', '.join(map(str, record['seeds']))}: uncompressed (grey) "
                 "and 1-bit (blue)", fontsize=10)
    return _save(fig, results_dir / "convergence-digits.png")


def _quick_options(quick: bool, compression: str) -> list[str]:
    # Few steps: compress after the fewest plain ones.
    return ["--warmup-iters", "2", "--freeze-step", "2"] if quick and compression == "onebit" else []


def _synth(data_dir: Path, recordings: int, seconds: float, epochs: int, seeds: Sequence[int],
           worlds: Sequence[int], quick: bool) -> Results:
    results = Results()
    for seed in seeds:
        data = ensure_dataset(data_dir, recordings, seconds, seed=seed)
        with tempfile.TemporaryDirectory(prefix="fuelline-conv-", dir=data_dir) as work, ExitStack() as stack:
            argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(data), "--port", "0",
                    "--batch-size", str(BATCH)]
            server = stack.enter_context(ServerProcess("server", argv, Path(work) / "serve.log"))
            endpoint = f"{server.host}:{server.port}"
            for world in worlds:
                for optimizer, options in CONFIGS.items():
                    for compression in COMPRESSIONS:
                        # A combination the trainer refuses is measured all the same (that is why it is refused).
                        extra = ["--compression", compression, "--accept-accuracy-loss",
                                 *_quick_options(quick, compression)]
                        results.train(_name(world, optimizer, compression), seed, endpoint, [*options, *extra],
                                      Path(work), epochs, world)
    return results


def _digits(data_dir: Path, tasks: Sequence[str], scale: float, epochs: int, seeds: Sequence[int],
            worlds: Sequence[int], quick: bool) -> dict[str, Results]:
    from benchmarks.digits import ensure_dataset as ensure_digits

    data = ensure_digits(data_dir, scale)
    results = {task: Results() for task in tasks}
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="fuelline-conv-digits-", dir=data_dir) as work, ExitStack() as stack:
            argv = [sys.executable, "-m", "fuelline.server.cli", "serve", str(data), "--port", "0",
                    "--batch-size", str(BATCH), "--seed", str(seed)]
            server = stack.enter_context(ServerProcess("server", argv, Path(work) / "serve.log"))
            endpoint = f"{server.host}:{server.port}"
            for task in tasks:
                for world in worlds:
                    for optimizer, options in DIGITS_CONFIGS.items():
                        for compression in COMPRESSIONS:
                            extra = ["--model", DIGITS_MODELS[task], "--classes", "10", "--compression", compression,
                                     "--accept-accuracy-loss", *_quick_options(quick, compression)]
                            results[task].train(_name(world, optimizer, compression), seed, endpoint,
                                                [*options, *extra], Path(work), epochs, world, label=f"{task} ")
    return results


def run(data_dir: Path, results_dir: Path = RESULTS_DIR, epochs: int = EPOCHS, seeds: Sequence[int] = SEEDS,
        worlds: Sequence[int] = WORLDS, quick: bool = False, tasks: Sequence[str] = TASKS,
        digits_epochs: int = DIGITS_EPOCHS, digits_scale: float = 1.0) -> dict[str, Any]:
    """Train every configuration of every task on every seed; write the record, tables and plots.

    ``quick``: a tiny run (QUICK: 2 epochs, one seed, W = 2) that shows the benchmark works, not
    how anything converges.
    """
    env = environment()
    recordings, seconds = RECORDINGS, SECONDS
    if quick:
        recordings, seconds, epochs, seeds, worlds = (QUICK[k] for k in ("recordings", "seconds", "epochs", "seeds",
                                                                          "worlds"))
        digits_epochs = QUICK["epochs"]
    synth = _synth(data_dir, recordings, seconds, epochs, seeds, worlds, quick) if "synth" in tasks else Results()
    digits_tasks = [t for t in TASKS if t in DIGITS_MODELS and t in tasks]
    digits: dict[str, Any] = {}
    if digits_tasks:
        digits = {"models": {t: DIGITS_MODELS[t] for t in digits_tasks}, "configs": DIGITS_CONFIGS,
                  "epochs": digits_epochs, "scale": digits_scale, "skipped": None, "tasks": {}}
        if importlib.util.find_spec("sklearn") is None:
            digits["skipped"] = (f"scikit-learn is not installed (pip install scikit-learn); {', '.join(digits_tasks)} "
                                 "not run")
            progress(f"digits: {digits['skipped']}")
        else:
            from benchmarks.digits import TRAIN_ROWS, VAL_ROWS

            digits |= {"train_rows": TRAIN_ROWS, "val_rows": VAL_ROWS}
            by_task = _digits(data_dir, digits_tasks, digits_scale, digits_epochs, seeds, worlds, quick)
            digits["tasks"] = {task: r.record() for task, r in by_task.items()}
    record = {"benchmark": "convergence", "environment": env, "tasks": [t for t in TASKS if t in tasks],
              "configs": CONFIGS, "epochs": epochs, "seeds": list(seeds), "worlds": list(worlds),
              "recordings": recordings, "seconds": seconds, "quick": quick, **synth.record(), "digits": digits}
    record = json.loads(json.dumps(record, default=str))  # as it will be read back: seeds as strings
    md = markdown(record)
    print(md, flush=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "convergence.json").write_text(json.dumps(record, indent=1))
    (results_dir / "convergence.md").write_text(md + "\n")
    if record["summary"]:
        plot(record, results_dir)
    if digits.get("tasks"):
        plot_digits(record, results_dir)
    return record


def _tasks(text: str) -> list[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in TASKS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(TASKS)}, got {text!r}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=_tasks, default=list(TASKS),
                   help=f"comma-separated, of {','.join(TASKS)} (default all)")
    p.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs per synth run (default {EPOCHS})")
    p.add_argument("--digits-epochs", type=int, default=DIGITS_EPOCHS,
                   help=f"epochs per digits run (default {DIGITS_EPOCHS})")
    p.add_argument("--digits-scale", type=float, default=1.0,
                   help="digits pixels are divided by this (default 1: 0..16 as shipped; 16: 0..1)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="model and data seeds (default 0 1 2)")
    p.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="world sizes (default 2 4)")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the data sets are made and reused")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where convergence.* are written")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (2 epochs, one seed, W = 2): checks that the benchmark works")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.digits_epochs < 1 or any(w < 1 for w in args.worlds):
        p.error("--epochs, --digits-epochs and --worlds must be >= 1")
    if not args.digits_scale > 0:
        p.error("--digits-scale must be > 0")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    run(args.data_dir, args.results_dir, args.epochs, args.seeds, args.worlds, quick=args.quick, tasks=args.tasks,
        digits_epochs=args.digits_epochs, digits_scale=args.digits_scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
