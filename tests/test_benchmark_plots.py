"""The benchmark plots and metrics take what a short or /proc-less run really yields: a CPU time
of zero clock ticks, or none measured at all."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

import matplotlib.pyplot as plt  # noqa: E402

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


def test_a_ratio_to_a_cpu_time_of_zero_is_no_ratio_and_no_crash() -> None:
    """A quick round's span may be too short for a CPU time to show: the ratios to it are NaN, the
    peers benchmark's table says '—' for them, and the rounds that measured one keep their ratio."""
    from benchmarks.peers.bench import FUELLINE, METRICS, PeerRound, _summary
    from benchmarks.report import RatioSpec

    def rnd(cpu: float) -> Round:
        return PeerRound(3, 1000, 64_000, 0.01, cpu, None, cpu_reader_s=0.5, peak_rss_bytes=1, first_batch_s=0.1,
                         first_batch_from_start_s=0.2, mix=1.0)

    cpu = METRICS[2].unit
    results = {FUELLINE: [rnd(0.0), rnd(0.02)], "other": [rnd(0.01), rnd(0.01)]}
    ratios = [RatioSpec(FUELLINE, "other", metric=cpu, higher=False), RatioSpec("other", FUELLINE, metric=cpu)]
    record, md = build_report("probe", "probe", results, METRICS, ratios, {}, [], environment(), exits={})
    back = record["ratios"][f"other / {FUELLINE} ({cpu})"]
    assert math.isnan(back["per_round"][0]) and back["per_round"][1] == pytest.approx(0.5)
    assert back["min_per_round"] == back["max_per_round"] == pytest.approx(0.5)
    assert record["ratios"][f"{FUELLINE} / other ({cpu})"]["per_round"] == pytest.approx([0.0, 2.0])
    for label in list(record["ratios"]):
        if not label.startswith(f"{FUELLINE} / other"):
            del record["ratios"][label]
    record["ratios"][f"{FUELLINE} / other"] = record["ratios"][f"{FUELLINE} / other ({cpu})"]
    record["ratios"][f"{FUELLINE} / other ({METRICS[3].unit})"] = record["ratios"][f"{FUELLINE} / other ({cpu})"]
    table = _summary(record, {})
    row = next(line for line in table.splitlines() if line.startswith("| other |"))
    assert "| 1.00 (0.50–—) |" in row, row  # medians 0.01 and 0.01; per round 1 / 2 and 1 / 0: none


def test_the_summary_is_written_beside_results_that_are_not_records(tmp_path: Path) -> None:
    # attacks.json is a list of findings; the summary reads every *.json in the folder.
    (tmp_path / "attacks.json").write_text('[{"attack": "flood"}]')
    paths = plots.summary(tmp_path)
    assert (tmp_path / "summary.md").read_text().startswith("## Benchmark summary")
    assert all(p.is_file() for p in paths)


def _headlines() -> list[dict]:
    """The recorded results' headlines, and rows of every kind they may lack: far above and below
    1, lower is better, no target."""
    def row(what: str, value: float, target: float | None, higher: bool = True) -> dict:
        meets = None if target is None else (value >= target if higher else value <= target)
        return {"benchmark": "probe", "what": what, "value": value, "target": target, "higher_is_better": higher,
                "meets": meets, "date": None}

    extra = [row("a ratio far above its target and the rest", 412.0, 20.0), row("a small share", 0.0041, 0.033, False),
             row("no target, " + "a long name that must wrap " * 3, 1.7, None), row("a miss", 0.5, 0.9)]
    return plots.headlines(RESULTS) + extra


def test_summary_bars_are_as_long_as_the_figures_printed_at_them() -> None:
    rows = _headlines()
    bars = plots.summary_bars(rows)
    assert [b["width"] for b in bars] == [r["value"] for r in rows]
    fig = plots.summary_figure(rows)
    try:
        (ax,) = fig.axes
        drawn = list(ax.containers[0])
        printed = [t.get_text() for t in ax.texts]
        assert len(drawn) == len(printed) == len(rows)
        for rect, text, r in zip(drawn, printed, rows):
            assert rect.get_x() == 0.0 and rect.get_width() == r["value"], r["what"]
            assert float(text.split()[0]) == pytest.approx(rect.get_width(), rel=5e-3), (text, r["what"])
        (marks,) = [line for line in ax.lines if line.get_label() == "target"]
        assert list(zip(marks.get_xdata(), marks.get_ydata())) == [
            (r["target"], i) for i, r in enumerate(rows) if r["target"] is not None]
    finally:
        plt.close(fig)


def test_every_label_of_the_summary_lies_inside_its_image() -> None:
    fig = plots.summary_figure(_headlines())
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        assert len(ax.get_yticklabels()) == len(_headlines())
        for label in [*ax.get_yticklabels(), ax.xaxis.label, ax.title, *ax.texts]:
            box = label.get_window_extent(renderer)
            assert 0 <= box.x0 and box.x1 <= fig.bbox.width, label.get_text()
            assert 0 <= box.y0 and box.y1 <= fig.bbox.height, label.get_text()
        drawn = ax.get_tightbbox(renderer)  # (also the tick labels the axis shows, and the legend)
        assert 0 <= drawn.x0 and drawn.x1 <= fig.bbox.width and 0 <= drawn.y0 and drawn.y1 <= fig.bbox.height
    finally:
        plt.close(fig)
