"""The benchmark plots and metrics take what a short or /proc-less run really yields: a CPU time
of zero clock ticks, or none measured at all."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import plots  # noqa: E402
from benchmarks.common import Round  # noqa: E402
from benchmarks.report import Metric, build_report, environment, server_cpu_ms_per_window  # noqa: E402


def _round(producer_cpu_s: float | None) -> Round:
    return Round(batches=3, rows=64, bytes=64_000, seconds=0.01, consumer_cpu_s=0.01, producer_cpu_s=producer_cpu_s)


def test_zero_ticks_is_zero_and_unmeasured_is_nan() -> None:
    cpu = server_cpu_ms_per_window()
    assert cpu.of(_round(0.0)) == 0.0
    assert cpu.of(_round(0.02)) == pytest.approx(1e3 * 0.02 / 64)
    assert math.isnan(cpu.of(_round(None)))


def test_contender_plot_with_unmeasured_and_zero_figures(tmp_path: Path) -> None:
    wps = Metric("windows/s", lambda r: r.rows / r.seconds)
    results = {"unmeasured": [_round(None), _round(None)], "measured": [_round(0.0), _round(0.0)]}
    record, md = build_report("probe", "probe", results, [wps, server_cpu_ms_per_window()], [], {}, [],
                              environment(), exits={})
    path = plots.contenders(record, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "probe" in md


def test_the_summary_is_written_beside_results_that_are_not_records(tmp_path: Path) -> None:
    # attacks.json is a list of findings; the summary reads every *.json in the folder.
    (tmp_path / "attacks.json").write_text('[{"attack": "flood"}]')
    paths = plots.summary(tmp_path)
    assert (tmp_path / "summary.md").read_text().startswith("## Benchmark summary")
    assert all(p.is_file() for p in paths)
