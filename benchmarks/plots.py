"""Plots of benchmark records (matplotlib, Agg: no display needed), and the summary that puts
every benchmark's headline ratio beside its target.

Contenders are bars at their median with the min–max of the rounds as error bars; targets and
reference figures are horizontal lines. In the summary each headline is a bar as long as its figure
(the number printed at it), and its target a mark on the bar's row.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

__all__ = ["contenders", "pipeline", "overlap", "scaling", "compression", "trainer", "for_record", "headlines", "summary",
           "summary_bars", "summary_figure"]

FUELLINE_COLOR, OTHER_COLOR, REF_COLOR, TARGET_COLOR = "#1f77b4", "#9a9a9a", "#d62728", "#2ca02c"


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _bars(ax: Any, record: dict[str, Any], unit: str, names: Sequence[str] | None = None) -> None:
    """Bars at the median with min–max error bars; a contender whose figure was not measured
    (NaN: no /proc to read a process's CPU time from) gets no bar and says so."""
    names = list(names or record["contenders"])
    stats = [record["contenders"][n][unit] for n in names]
    measured = [all(math.isfinite(s[k]) for k in ("median", "min", "max")) for s in stats]
    med = [s["median"] if ok else 0.0 for s, ok in zip(stats, measured)]
    err = [[m - s["min"] if ok else 0.0 for m, s, ok in zip(med, stats, measured)],
           [s["max"] - m if ok else 0.0 for m, s, ok in zip(med, stats, measured)]]
    colors = [FUELLINE_COLOR if "fuelline" in n.lower() else OTHER_COLOR for n in names]
    ax.bar(range(len(names)), med, yerr=err, capsize=4, color=colors)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace(", ", ",\n").replace(" + ", " +\n") for n in names], fontsize=8)
    ax.set_ylabel(f"{unit} (median, min–max)")
    for i, (m, st, ok) in enumerate(zip(med, stats, measured)):
        ax.text(i, st["max"] if ok else 0.0, _fmt(m) if ok else "not measured", ha="center", va="bottom", fontsize=8)
    top = max((s["max"] for s, ok in zip(stats, measured) if ok), default=0.0)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _line(ax: Any, y: float, label: str, color: str = REF_COLOR, style: str = "--") -> None:
    ax.axhline(y, color=color, linestyle=style, linewidth=1.2, label=label)
    lo, hi = ax.get_ylim()
    if y > hi * 0.95:
        ax.set_ylim(lo, y * 1.08)


def contenders(record: dict[str, Any], results_dir: Path, name: str | None = None,
               refs: Sequence[tuple[float, str, str]] = ()) -> Path:
    """Any ``build_report`` record: one panel per metric, bars per contender, ``refs`` lines
    (value, label, color) on the first panel."""
    units = record["metrics"]
    fig, axes = plt.subplots(1, len(units), figsize=(max(5.0, 1.6 * len(record["contenders"])) * len(units), 4.2),
                             squeeze=False)
    for i, unit in enumerate(units):
        ax = axes[0][i]
        _bars(ax, record, unit)
        if i == 0:
            for value, label, color in refs:
                _line(ax, value, label, color)
            if refs:
                ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(record.get("title", record["benchmark"]), fontsize=10)
    return _save(fig, results_dir / f"{name or record['benchmark']}.png")


def pipeline(record: dict[str, Any], results_dir: Path) -> Path:
    ref = record["reference_windows_per_s"]
    return contenders(record, results_dir, refs=[(ref, f"Arrow pipeline, {ref:.0f}/s", REF_COLOR),
                                                 (20 * ref, f"target 20 × {ref:.0f}/s", TARGET_COLOR)])


def overlap(record: dict[str, Any], results_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _bars(ax, record, record["metrics"][0])
    _line(ax, 1.0, "ideal: training alone, nominal", REF_COLOR)
    _line(ax, record["target_max"], f"target ≤ {record['target_max']:.2f}", TARGET_COLOR, ":")
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(record["title"], fontsize=10)
    return _save(fig, results_dir / "overlap.png")


def scaling(record: dict[str, Any], results_dir: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, (key, xlabel) in zip(axes, (("clients", "concurrent clients (one server)"),
                                        ("batch_size", "batch size (one client)"))):
        series = [(record[key], "decoded units shared" if key == "clients" else None, FUELLINE_COLOR)]
        if key == "clients" and "clients_unshared" in record:
            series.append((record["clients_unshared"], "unshared (--decoded-cache-mb 0)", OTHER_COLOR))
        top = 0.0
        for part, label, color in series:
            xs = part["x"]
            stats = [part["windows/s"][str(x)] for x in xs]
            med = [s["median"] for s in stats]
            err = [[m - s["min"] for m, s in zip(med, stats)], [s["max"] - m for m, s in zip(med, stats)]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=4, color=color, label=label)
            top = max(top, max(s["max"] for s in stats))
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("aggregate windows/s (median, min–max)")
        ax.set_ylim(0, top * 1.15)
        ref = record["reference_windows_per_s"]
        _line(ax, ref, f"Arrow pipeline, {ref:.0f}/s")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(record["title"], fontsize=10)
    return _save(fig, results_dir / "scaling.png")


def compression(record: dict[str, Any], results_dir: Path) -> Path:
    names = list(record["configs"])
    rows = [record["configs"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    bpe = [r["grad_bytes_per_element"] or 0.0 for r in rows]
    axes[0].bar(range(len(names)), bpe, color=[FUELLINE_COLOR if n == "onebit" else OTHER_COLOR for n in names])
    for i, v in enumerate(bpe):
        axes[0].text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    axes[0].set_ylabel("gradient bytes per element, per rank")
    _line(axes[0], record["fp32_ring_bytes_per_element"], "fp32 ring all-reduce")
    _line(axes[0], record["fp32_ring_bytes_per_element"] * record["target_of_fp32"],
          f"target {record['target_of_fp32']:.1%} of fp32 ring", TARGET_COLOR, ":")
    axes[0].legend(fontsize=8)
    step = [r["step_time_ms"] for r in rows]
    err = [[s["median"] - s["min"] for s in step], [s["max"] - s["median"] for s in step]]
    axes[1].bar(range(len(names)), [s["median"] for s in step], yerr=err, capsize=4,
                color=[FUELLINE_COLOR if n == "onebit" else OTHER_COLOR for n in names])
    axes[1].set_ylabel("step time, ms (median, min–max over rounds)")
    for ax in axes:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
    fig.suptitle(record["title"], fontsize=10)
    return _save(fig, results_dir / "compression.png")


def trainer(record: dict[str, Any], results_dir: Path) -> Path:
    """The training benchmark: per configuration, bytes per element, step time and final accuracy
    (medians over its rounds)."""
    summary = record["summary"]
    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    panels = (("grad_bytes_per_element", "gradient bytes per element", 1.0),
              ("step_time_s", "step time, ms", 1e3), ("final_accuracy", "final val accuracy", 1.0))
    for ax, (key, label, scale) in zip(axes, panels):
        values = [(summary[n][key] or 0.0) * scale for n in names]
        ax.bar(range(len(names)), values, color=[FUELLINE_COLOR if "onebit" in n else OTHER_COLOR for n in names])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace(" ", "\n", 1) for n in names], fontsize=7)
        ax.set_ylabel(label + " (median)")
    fig.suptitle(f"trainer — {record['epochs']} epochs, W = {record['world_size']}", fontsize=10)
    return _save(fig, results_dir / "trainer.png")


def for_record(record: dict[str, Any], results_dir: Path) -> Path:
    """The plot of an existing benchmark's record (transport, parquet, windows, scaleout)."""
    refs: list[tuple[float, str, str]] = []
    if "reference_windows_per_s" in record:
        ref = record["reference_windows_per_s"]
        refs = [(ref, f"Arrow pipeline, {ref:.0f}/s", REF_COLOR)]
    return contenders(record, results_dir, refs=refs)


# -- the summary ------------------------------------------------------------------------------------
def _load(results_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((results_dir / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def headlines(results_dir: Path) -> list[dict[str, Any]]:
    """Each benchmark's headline figures found in ``results_dir``: what, value, target, and
    whether higher is better."""
    out: list[dict[str, Any]] = []

    def add(bench: str, what: str, value: float | None, target: float | None, higher: bool = True) -> None:
        if value is None:
            return
        meets = None if target is None else (value >= target if higher else value <= target)
        date = (_load(results_dir, bench) or {}).get("date")
        out.append({"benchmark": bench, "what": what, "value": value, "target": target,
                    "higher_is_better": higher, "meets": meets, "date": date})

    def ratio(rec: dict[str, Any], key: str) -> float | None:
        r = rec.get("ratios", {}).get(key)
        return None if r is None else r["of_medians"]

    if (rec := _load(results_dir, "transport")) is not None:
        for key, r in rec["ratios"].items():
            add("transport", key + " (GB/s)", r["of_medians"], r["target"])
    if (rec := _load(results_dir, "parquet")) is not None:
        for key, r in rec["ratios"].items():
            add("parquet", key + " (rows/s)", r["of_medians"], r["target"])
    if (rec := _load(results_dir, "pipeline")) is not None:
        best = rec["best_dataloader"]
        add("pipeline", "fuelline serve / in-process (windows/s)", ratio(rec, "fuelline serve / in-process WindowSource"), 1.0)
        add("pipeline", f"fuelline serve / best DataLoader ({best})", ratio(rec, f"fuelline serve / {best}"), 1.5)
        if ratio(rec, "fuelline serve ×2 / in-process WindowSource") is not None:
            add("pipeline", "fuelline serve ×2 (two server processes) / in-process",
                ratio(rec, "fuelline serve ×2 / in-process WindowSource"), 1.0)
            add("pipeline", f"fuelline serve ×2 / best DataLoader ({best})", ratio(rec, f"fuelline serve ×2 / {best}"), 1.5)
        procs = "fuelline serve --processes 2, 2 connections"
        if ratio(rec, f"{procs} / in-process WindowSource") is not None:
            add("pipeline", "--processes 2, 2 connections / in-process", ratio(rec, f"{procs} / in-process WindowSource"), 1.0)
            add("pipeline", f"--processes 2, 2 connections / best DataLoader ({best})", ratio(rec, f"{procs} / {best}"), 1.5)
        add("pipeline", "fuelline serve / 980 windows/s", rec["served_over_reference"]["value"], 20.0)
        if "kept_over_reference" in rec:
            add("pipeline", "served, decoded units kept / 980/s (not like for like)",
                rec["kept_over_reference"], None)
    if (rec := _load(results_dir, "overlap")) is not None:
        add("overlap", "start_server + ServerDataStream: time / ideal", rec["served_over_ideal"], rec["target_max"], False)
        if rec.get("served_over_alone_per_round") is not None:
            add("overlap", "start_server + ServerDataStream / training alone", rec["served_over_alone_per_round"],
                rec["target_max"], False)
        add("overlap", "single process: time / ideal", rec["single_over_ideal"], None, False)
    if (rec := _load(results_dir, "scaling")) is not None:
        c = rec["clients"]
        add("scaling", f"aggregate windows/s, {c['x'][-1]} clients / 1 client", c["speedup_at_max"], 1.0)
        if "clients_unshared" in rec:
            u = rec["clients_unshared"]
            add("scaling", f"same, decoded units unshared ({u['x'][-1]} clients / 1)", u["speedup_at_max"], None)
        # One server of several serving processes, held to the same target against its own one client.
        for key, r in rec.get("ratios", {}).items():
            if "--processes" in key and r.get("target") is not None:
                add("scaling", key + " (windows/s)", r["of_medians"], r["target"])
        b = rec["batch_size"]
        add("scaling", f"windows/s, batch {b['x'][-1]} / batch {b['x'][0]}", b["speedup_at_max"], None)
    if (rec := _load(results_dir, "compression")) is not None:
        onebit = rec["configs"].get("onebit")
        if onebit is not None and onebit.get("of_fp32_ring") is not None:
            add("compression", "onebit bytes/element / fp32 ring", onebit["of_fp32_ring"], rec["target_of_fp32"], False)
    if (rec := _load(results_dir, "windows")) is not None:
        for key, r in rec["ratios"].items():
            unit = "" if r.get("metric", "windows/s") != "windows/s" else " (windows/s)"
            add("windows", key + unit, r["of_medians"], r["target"], r.get("higher_is_better", True))
    return out


def _any_quick(results_dir: Path) -> bool:
    for path in results_dir.glob("*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict):  # (attacks.json is a list of findings)
            continue
        if rec.get("quick") or rec.get("parameters", {}).get("quick") or rec.get("from_trainer", {}).get("quick"):
            return True
    return False


SUMMARY_LABEL_WIDTH = 46  # characters of a headline's label per line, so that no label is cut


def summary_bars(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the summary plot draws for each of ``headlines()``'s rows: its label (wrapped), the
    bar's width, which is the figure itself, the text printed at the bar (the same figure), the
    target's place (None: no target) and the bar's color (met, missed, no target)."""
    bars = []
    for r in rows:
        if r["target"] is None:
            color, note = OTHER_COLOR, ""
        else:
            color = TARGET_COLOR if r["meets"] else REF_COLOR
            note = f"  (target {'≥' if r['higher_is_better'] else '≤'} {r['target']:.3g})"
        bars.append({"label": textwrap.fill(f"{r['benchmark']}: {r['what']}", SUMMARY_LABEL_WIDTH),
                     "width": r["value"], "text": f"{r['value']:.3g}{note}",
                     "target": r["target"], "color": color})
    return bars


def summary_figure(rows: Sequence[dict[str, Any]], quick: bool = False) -> Any:
    """The headlines as bars whose length is the figure printed at them, on a log scale (they
    span ratios from hundredths to tens), each target a black mark on its bar's row."""
    bars = summary_bars(rows)
    wrapped = sum(b["label"].count("\n") for b in bars)
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(bars) + 0.1 * wrapped + 1.6))
    ys = list(range(len(bars)))
    # From 0, so a bar's width is its figure; a log axis shows it from the axis' left edge.
    ax.barh(ys, [b["width"] for b in bars], left=0.0, color=[b["color"] for b in bars], height=0.7)
    marked = [(b["target"], y) for b, y in zip(bars, ys) if b["target"] is not None]
    if marked:
        ax.plot([t for t, _ in marked], [y for _, y in marked], linestyle="none", marker="|", markersize=14,
                markeredgewidth=2.5, color="black", label="target")
    ax.set_xscale("log")
    ends = [b["width"] for b in bars if b["width"] > 0] + [t for t, _ in marked if t > 0] or [1.0]
    ax.set_xlim(10 ** math.floor(math.log10(min(ends)) - 0.3), max(ends) * 12)
    for y, b in zip(ys, bars):  # (past the target's mark, which may lie beyond the bar)
        ax.text(max(b["width"], b["target"] or 0.0) * 1.12, y, b["text"], va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.6, linestyle=":")
    ax.set_yticks(ys)
    ax.set_yticklabels([b["label"] for b in bars], fontsize=7)
    ax.set_ylim(max(len(bars), 1) - 0.5, -0.5)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("the figure: a ratio of medians (log scale; the dotted line is 1)")
    from matplotlib.patches import Patch

    handles = [Patch(color=TARGET_COLOR, label="meets its target"), Patch(color=REF_COLOR, label="misses it"),
               Patch(color=OTHER_COLOR, label="no target")]
    handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    ax.set_title("fuelline benchmarks: headline ratios and their targets"
                 + ("\n(QUICK RUN: not a measurement)" if quick else ""), fontsize=10)
    fig.tight_layout()
    return fig


def summary(results_dir: Path) -> list[Path]:
    """``summary.md`` and ``summary.png``: every headline beside its target."""
    rows = headlines(results_dir)
    quick = _any_quick(results_dir)
    lines = ["## Benchmark summary", "",
             *(["**Quick run**: tiny sizes and 2 rounds, a check that every benchmark works; these figures "
                "measure nothing.", ""] if quick else []), "| benchmark | figure | value | target | verdict | measured |", "|---|---|---:|---:|---|---|"]
    for r in rows:
        target = "–" if r["target"] is None else ("≥ " if r["higher_is_better"] else "≤ ") + f"{r['target']:.3g}"
        verdict = "–" if r["meets"] is None else ("meets" if r["meets"] else "MISSES")
        lines.append(f"| {r['benchmark']} | {r['what']} | {r['value']:.3g} | {target} | {verdict} | {r['date'] or '–'} |")
    lines += ["", "Each figure is a ratio of medians taken within one run of its benchmark (contenders "
              "alternately); see `<benchmark>.md` for rounds, ranges and conditions.", ""]
    results_dir.mkdir(parents=True, exist_ok=True)
    md = results_dir / "summary.md"
    tmp = md.with_name("summary.md.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, md)
    return [md, _save(summary_figure(rows, quick), results_dir / "summary.png")]
