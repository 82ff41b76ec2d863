"""The report of a benchmark run: medians, ranges and ratios, printed as markdown and written
as ``<name>.json`` and ``<name>.md``, with where and with what the figures were taken."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks.common import RESULTS_DIR, ROOT, Round

__all__ = ["Metric", "RatioSpec", "environment", "build_report", "write_results"]


@dataclass(frozen=True)
class Metric:
    """A figure derived from a Round; the first metric of a report is the one ratios compare."""

    unit: str
    of: Callable[[Round], float]
    fmt: str = "{:,.3g}"


def server_cpu_ms_per_window() -> Metric:
    """CPU milliseconds of the sending process (its worker processes included) per window; NaN
    where it was not measured."""

    def of(r: Round) -> float:
        return float("nan") if r.producer_cpu_s is None else 1e3 * r.producer_cpu_s / r.rows

    return Metric("server CPU ms/window", of, "{:.3f}")


@dataclass(frozen=True)
class RatioSpec:
    """numerator / denominator of a metric's medians (``metric``: a unit; default the report's
    first), against a target it should reach (``higher``) or stay under."""

    numerator: str
    denominator: str
    target: float | None = None
    metric: str | None = None
    higher: bool = True


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def _quotient(n: float, d: float) -> float:
    """n / d, or NaN where d is zero: a CPU time that a short span measured as none makes no ratio."""
    return n / d if d else math.nan


def _ratio(num: Sequence[float], den: Sequence[float], target: float | None, higher: bool = True) -> dict[str, Any]:
    per_round = [_quotient(n, d) for n, d in zip(num, den)]
    of_medians = _quotient(statistics.median(num), statistics.median(den))
    defined = [q for q in per_round if not math.isnan(q)] or [math.nan]
    meets = None if target is None or math.isnan(of_medians) else (
        of_medians >= target if higher else of_medians <= target)
    return {
        "of_medians": of_medians,
        "median_per_round": statistics.median(defined),
        "min_per_round": min(defined),
        "max_per_round": max(defined),
        "per_round": per_round,
        "target": target,
        "higher_is_better": higher,
        "median_meets_target": meets,
    }


def _cpu_per_gb(r: Round) -> float | None:
    if not r.bytes:
        return None
    return (r.consumer_cpu_s + (r.producer_cpu_s or 0.0)) / (r.bytes / 1e9)


def environment() -> dict[str, Any]:
    """Where and with what the figures were taken."""
    import pyarrow
    import zmq

    versions = {"python": platform.python_version(), "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version(),
                "pyarrow": pyarrow.__version__, "numpy": np.__version__}
    for dist in ("fuelline", "msgpack", "xxhash"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                    "loadavg_at_start": _loadavg()},
        "versions": versions,
        "source": _source_revision(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _source_revision() -> dict[str, Any]:
    """The commit measured, and whether the tree had uncommitted changes (figures then describe
    code that no commit holds)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def build_report(
    name: str,
    title: str,
    results: dict[str, list[Round]],
    metrics: Sequence[Metric],
    ratios: Sequence[RatioSpec],
    parameters: dict[str, Any],
    notes: Sequence[str],
    env: dict[str, Any],
    exits: dict[str, dict[str, Any]],
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """The JSON record and the markdown text of one benchmark run.

    ``exits`` is how each sending process ended when told to stop: a server that crashes on the
    way out is a finding too, and belongs next to its figures.
    """
    primary = metrics[0]
    record: dict[str, Any] = {"benchmark": name, "title": title, **env, "parameters": parameters,
                              "metrics": [m.unit for m in metrics], "contenders": {}, "ratios": {}}
    record["machine"]["loadavg_at_end"] = _loadavg()
    for contender, rounds in results.items():
        entry: dict[str, Any] = {"rounds": [asdict(r) for r in rounds]}
        for m in metrics:
            entry[m.unit] = _stats([m.of(r) for r in rounds])
        cpu = [c for c in (_cpu_per_gb(r) for r in rounds) if c is not None]
        entry["cpu_s_per_gb"] = _stats(cpu) if cpu else None
        by_thread = _cpu_ms_per_batch_by_thread(rounds)
        if by_thread:
            entry["cpu_ms_per_batch_by_thread"] = by_thread
        record["contenders"][contender] = entry
    by_unit = {m.unit: m for m in metrics}
    for spec in ratios:
        metric = by_unit[spec.metric] if spec.metric else primary
        num = [metric.of(r) for r in results[spec.numerator]]
        den = [metric.of(r) for r in results[spec.denominator]]
        label = f"{spec.numerator} / {spec.denominator}" + (f" ({metric.unit})" if spec.metric else "")
        record["ratios"][label] = {**_ratio(num, den, spec.target, spec.higher), "metric": metric.unit}
    record["notes"] = list(notes)
    record["process_exits"] = exits
    if extra:
        record.update(extra)
    return record, _markdown(record, title, metrics)


def _cpu_ms_per_batch_by_thread(rounds: Sequence[Round]) -> dict[str, float] | None:
    """Median over rounds of each thread role's CPU ms per timed batch (the batches after the
    first, whose span ``time_batches`` takes it over); None where no round measured threads."""
    measured = [r for r in rounds if r.threads_cpu_s is not None and r.batches > 1]
    if not measured:
        return None
    roles = sorted({role for r in measured for role in r.threads_cpu_s or {}})
    return {role: statistics.median(1e3 * (r.threads_cpu_s or {}).get(role, 0.0) / (r.batches - 1) for r in measured)
            for role in roles}


def _markdown(record: dict[str, Any], title: str, metrics: Sequence[Metric]) -> str:
    rounds = len(next(iter(record["contenders"].values()))["rounds"])
    head = ["contender"]
    for m in metrics:
        head += [f"median {m.unit}", f"min–max {m.unit}"]
    head += ["CPU s/GB (both ends)", "rounds"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for contender, entry in record["contenders"].items():
        cells = [contender]
        for m in metrics:
            s = entry[m.unit]
            cells += [m.fmt.format(s["median"]), f"{m.fmt.format(s['min'])}–{m.fmt.format(s['max'])}"]
        cpu = entry["cpu_s_per_gb"]
        cells += [f"{cpu['median']:.2f}" if cpu else "–", str(rounds)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Ratios (of {metrics[0].unit} unless named):", ""]
    for label, r in record["ratios"].items():
        target = ""
        if r["target"] is not None:
            higher = r.get("higher_is_better", True)
            verdict = "meets" if r["median_meets_target"] else ("below" if higher else "above")
            target = f"; target {'≥' if higher else '≤'} {r['target']:.2f} ({verdict})"
        lines.append(
            f"- {label}: {r['of_medians']:.3f} (ratio of medians); median of per-round ratios "
            f"{r['median_per_round']:.3f}, min–max {r['min_per_round']:.3f}–{r['max_per_round']:.3f}{target}"
        )
    split = {name: e["cpu_ms_per_batch_by_thread"] for name, e in record["contenders"].items()
             if e.get("cpu_ms_per_batch_by_thread")}
    if split:
        lines += ["", "CPU ms per batch by thread (median of rounds; main: a server's serving loop, which gathers and "
                  "places a unit source's batches itself, or a consumer's own work; producers: threads that prepare "
                  "the batches of other sources; read-ahead: decoding; libzmq: its I/O threads):", ""]
        lines += [f"- {name}: " + ", ".join(f"{role} {ms:.3f}" for role, ms in sorted(roles.items(), key=lambda kv: -kv[1])
                                          if ms >= 0.0005)
                  for name, roles in split.items()]
    m, v = record["machine"], record["versions"]
    lines += [
        "",
        "Notes:",
        "",
        *[f"- {n}" for n in record["notes"]],
        "- Sending processes when stopped (SIGTERM for servers): "
        + "; ".join(f"{k}: exit {v.get('exit_code')}" + ("" if v.get("clean") else " (NOT clean)") for k, v in record["process_exits"].items())
        + ".",
        f"- {record['date']}; {m['cpu_count']} CPUs, {m['platform']}; load average {m['loadavg_at_start']} at start, "
        f"{m['loadavg_at_end']} at end.",
        "- " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        f"- source: commit {record['source']['commit']}" + (" with uncommitted changes" if record["source"]["dirty"] else "") + ".",
        "",
    ]
    return "\n".join(lines)


def write_results(name: str, record: dict[str, Any], markdown: str, results_dir: Path = RESULTS_DIR) -> list[Path]:
    """Write ``<name>.json`` and ``<name>.md``, each through a temporary file and a rename, so an
    interrupted run never leaves half a result behind."""
    results_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in ((results_dir / f"{name}.json", json.dumps(record, indent=2) + "\n"),
                       (results_dir / f"{name}.md", markdown)):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        written.append(path)
    return written
