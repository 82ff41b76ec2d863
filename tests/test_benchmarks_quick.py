"""``python -m benchmarks --quick`` runs every benchmark end to end (real server processes, real
sockets, tiny sizes) and writes every result file. Correctness only: no figure is judged for speed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("moto")

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240

REPORTS = ("transport", "parquet", "windows", "pipeline", "overlap", "scaling", "scaleout-workers", "scaleout-storage")
WITH_PLOT = (*REPORTS, "compression", "trainer")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    work = tmp_path_factory.mktemp("bench-quick")
    results = work / "results"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--results-dir", str(results), "--data-dir", str(work / "data")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    return proc, results


def _record(results: Path, name: str) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text())


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_quick_run_exits_zero_and_writes_every_file(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, results = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in (*REPORTS, "compression", "trainer"):
        for ext in ("json", "md"):
            path = results / f"{name}.{ext}"
            assert path.is_file() and path.stat().st_size > 0, f"{path} missing or empty"
    for name in (*WITH_PLOT, "summary"):
        path = results / f"{name}.png"
        assert path.is_file(), f"{path} missing"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert (results / "summary.md").read_text().startswith("## Benchmark summary")
    assert not list(results.glob("*.tmp*")), "a temporary file was left behind"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_reports_have_positive_figures_and_ratios(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, results = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in REPORTS:
        record = _record(results, name)
        assert record["contenders"], name
        for contender, entry in record["contenders"].items():
            assert entry["rounds"], (name, contender)
            for unit in record["metrics"][:1]:
                assert entry[unit]["median"] > 0 and entry[unit]["min"] > 0, (name, contender, unit)
        for label, ratio in record["ratios"].items():
            assert ratio["of_medians"] > 0 and len(ratio["per_round"]) == len(next(iter(record["contenders"].values()))["rounds"]), (name, label)
            if ratio["target"] is not None:
                assert isinstance(ratio["median_meets_target"], bool), (name, label)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_headline_figures_are_computed(quick_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, results = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]

    transport = _record(results, "transport")
    assert {"bare pyzmq", "bare pyzmq, ipc", "bare pyzmq + xxh3", "fuelline", "fuelline, local"} <= set(
        transport["contenders"])
    # The ceiling of a checksummed transport, and fuelline's share of it, beside the target's ratio.
    assert {"bare pyzmq + xxh3 / bare pyzmq", "fuelline / bare pyzmq + xxh3",
            "fuelline / bare pyzmq + copy + xxh3"} <= set(transport["ratios"])
    assert transport["ratios"]["fuelline / bare pyzmq"]["target"] == 0.8
    # The protocol alone (no copy, no checksum) against bare pyzmq, and where each end's CPU goes.
    assert transport["ratios"]["fuelline, fresh_arrays --no-checksum / bare pyzmq"]["target"] == 0.8
    for name, ends in (("bare pyzmq", ("sender", "receiver")), ("fuelline, fresh_arrays --no-checksum", ("server", "client"))):
        by_thread = transport["contenders"][name]["cpu_ms_per_batch_by_thread"]
        assert {f"{end} {role}" for end in ends for role in ("main", "libzmq")} <= set(by_thread), by_thread
        assert by_thread[f"{ends[1]} libzmq"] > 0, by_thread  # (it receives every batch's bytes)

    pipeline = _record(results, "pipeline")
    names = set(pipeline["contenders"])
    assert {"fuelline serve", "in-process WindowSource", "DataLoader, 0 workers", "DataLoader, 1 worker",
            "DataLoader, 2 workers"} <= names
    assert pipeline["best_dataloader"] in names
    assert "fuelline serve / in-process WindowSource" in pipeline["ratios"]
    assert f"fuelline serve / {pipeline['best_dataloader']}" in pipeline["ratios"]
    # The targets: at least the in-process pipeline, at least 1.5 × the best DataLoader;
    # the same two for one client reading from two servers on the host, and from two processes of one.
    for served in ("fuelline serve", "fuelline serve ×2", "fuelline serve --processes 2, 2 connections"):
        assert pipeline["ratios"][f"{served} / in-process WindowSource"]["target"] == 1.0
        assert pipeline["ratios"][f"{served} / {pipeline['best_dataloader']}"]["target"] == 1.5
    assert pipeline["served_over_reference"]["value"] > 0
    assert isinstance(pipeline["served_over_reference"]["meets_target"], bool)
    # Where each side's CPU goes, by thread: a server's serving loop, which prepares the batches of
    # a unit source itself (no producer threads, fl-produce), and its read-ahead threads; the
    # in-process consumer's own thread, and no producer.
    for served in ("fuelline serve", "fuelline serve --processes 2, 2 connections"):
        split = pipeline["contenders"][served]["cpu_ms_per_batch_by_thread"]
        assert split["main"] > 0 and split["read-ahead"] > 0 and split.get("producers", 0.0) == 0.0, (served, split)
    in_process = pipeline["contenders"]["in-process WindowSource"]["cpu_ms_per_batch_by_thread"]
    assert in_process["main"] > 0 and in_process.get("producers", 0.0) == 0.0, in_process
    assert "CPU ms per batch by thread" in (results / "pipeline.md").read_text()

    overlap = _record(results, "overlap")
    for key in ("served_over_ideal", "single_over_ideal", "alone_over_ideal", "served_over_alone", "ideal_s"):
        assert overlap[key] > 0, key
    assert isinstance(overlap["meets_target"], bool)

    scaling = _record(results, "scaling")
    assert scaling["clients"]["x"] == [1, 2, 4, 8]
    several = ("1 client, --processes 2", "8 clients, --processes 2")
    assert {"1 client, 2 servers", "8 clients, 2 servers", *several} <= set(scaling["contenders"])
    assert scaling["ratios"]["8 clients / 1 client"]["target"] == 1.0
    assert scaling["ratios"]["8 clients, --processes 2 / 1 client, --processes 2"]["target"] == 1.0
    for name in ("1 client, 2 servers", "8 clients, 2 servers", *several):  # every server process's CPU, measured
        assert all(r["producer_cpu_s"] > 0 for r in scaling["contenders"][name]["rounds"]), name
    # The decoded units of a server of several processes are counted across them (their metrics, merged).
    assert all(v > 0 for v in scaling["contenders"][several[1]]["units decoded/epoch"]["values"])
    # Starting is measured apart from the timed span: every client had its first batch some time after it was asked.
    assert all(0 < v < 60 for v in scaling["contenders"]["8 clients"]["s to the last client's first batch"]["values"])
    # Each round's split of the batches among the processes (from their merged metrics), in the notes.
    split = next(n for n in scaling["notes"] if n.startswith(f"{several[1]}, each round's windows/s"))
    shares = [[int(x) for x in m.split("/")] for m in re.findall(r"\(([\d/]+) %\)", split)]
    assert len(shares) == 2 and all(len(s) == 2 and 99 <= sum(s) <= 101 for s in shares), split
    for part in ("clients", "batch_size"):
        assert all(s["median"] > 0 for s in scaling[part]["windows/s"].values()), part
        assert scaling[part]["speedup_at_max"] > 0

    compression = _record(results, "compression")
    assert set(compression["configs"]) == {"none", "fp16", "onebit"}
    for name, c in compression["configs"].items():
        assert c["grad_bytes_per_element"] > 0 and c["step_time_ms"]["median"] > 0, name
    assert compression["configs"]["fp16"]["grad_bytes_per_element"] < compression["configs"]["none"]["grad_bytes_per_element"]

    summary = (results / "summary.md").read_text()
    for bench in ("transport", "pipeline", "overlap", "scaling", "compression"):
        assert f"| {bench} |" in summary, bench
    # Target 7 is held for one server of several serving processes too, beside one of one.
    assert "| scaling | 8 clients, --processes 2 / 1 client, --processes 2 (windows/s) |" in summary


def _run_quick(name: str, results: Path, timeout: float) -> None:
    """``python -m benchmarks NAME --quick --results-dir RESULTS``, which must exit 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", name, "--quick", "--results-dir", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_quick_exchange_benchmark_runs_and_reports_both_contenders(tmp_path: Path) -> None:
    _run_quick("exchange", tmp_path, RUN_TIMEOUT_S - 20)
    record = _record(tmp_path, "exchange")
    assert [(c["what"], c["world"]) for c in record["cases"]] == [("exchange", 2), ("step", 2)]
    for case in record["cases"]:
        for key in ("uncompressed_ms", "onebit_ms"):
            assert all(v > 0 for v in case["after"][key]["values"]), case
    assert "| loopback | 2 | Adam step |" in (tmp_path / "exchange.md").read_text()


@pytest.mark.timeout(120)
def test_quick_fuel_stream_benchmark_reports_fuelline_on_the_host_and_over_tcp(tmp_path: Path) -> None:
    _run_quick("fuel-stream", tmp_path, 100)
    record = _record(tmp_path, "fuel-stream")
    for name in ("fuelline", "fuelline, TCP"):
        rounds = record["contenders"][name]["rounds"]
        assert len(rounds) == 2 and all(r["batches"] == 20 and r["bytes"] == 19 * 256 * 3000 * 4 for r in rounds)
        assert record["contenders"][name]["GB/s"]["median"] > 0
    assert "fuelline, TCP / fuelline" in record["ratios"]


@pytest.mark.timeout(120)
def test_quick_first_batch_benchmark_times_both_readers_from_the_servers_spawn(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "first-batch", "--gb", "0.005", "--row-group-rows", "512",
                           "--rounds", "2", "--world", "3", "--results-dir", str(tmp_path / "results"),
                           "--data-dir", str(tmp_path / "data")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads((tmp_path / "results" / "first-batch.json").read_text())
    readers = record["results"]["fuelline"]
    assert set(readers) == {"rank 0 of 1", "rank 2 of 3"}
    for got in readers.values():
        assert len(got["rounds"]) == 2
        assert all(0 < r["ready_s"] < r["first_batch_s"] for r in got["rounds"])
    assert "| fuelline | rank 2 of 3 |" in (tmp_path / "results" / "first-batch.md").read_text()


def test_the_guard_names_each_ratio_that_dropped_by_more_than_a_fifth() -> None:
    from benchmarks.guard import compare

    def ratio(value: float) -> dict[str, Any]:
        return {"ratio": value, "per_round": [value], "numerator": "a", "denominator": "b"}

    recorded = {"fuel stream": ratio(2.0), "transport": ratio(0.8), "table": ratio(1.0)}
    now = {"fuel stream": ratio(1.59), "transport": ratio(0.65), "table": ratio(1.3), "windows": ratio(3.0)}
    lines, dropped = compare(now, recorded)
    assert dropped == ["fuel stream"]  # 0.795 of its record; transport kept 0.8125 of its own
    assert any(line.startswith("| windows") and "| — |" in line for line in lines)  # no record yet: never a drop


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_quick_peers_benchmark_records_fuelline_and_the_dataloader(tmp_path: Path) -> None:
    """``python -m benchmarks.peers --quick`` with the peers that need nothing extra (no peer's
    environment is built or run): rows/s and the batch mix of both, every row once an epoch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--quick", "--peers", "dataloader-0",
                           "--results-dir", str(tmp_path / "results"), "--data-dir", str(tmp_path / "data")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S - 20)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = _record(tmp_path / "results", "peers")
    fuelline, loader = "fuelline serve → ServerDataStream(tensors=True)", "DataLoader over pyarrow, 0 workers"
    assert set(record["contenders"]) == {fuelline, loader}
    for name in (fuelline, loader):
        entry = record["contenders"][name]
        assert len(entry["rounds"]) == 2, name
        assert entry["rows/s"]["min"] > 0 and entry["CPU s/1k rows"]["min"] > 0, name
        # A shuffled batch of 1024 rows mixes several of the 40 row groups of 500 rows.
        assert 2 <= entry["row groups/batch"]["min"] <= 40, (name, entry["row groups/batch"])
        assert all(r["epoch_distinct_rows"] == [20_000, 20_000] for r in entry["rounds"]), name
        assert 0 < entry["s to first batch"]["max"] <= entry["s to first batch, from start"]["max"], name
    assert f"{fuelline} / {loader}" in record["ratios"]
    assert len(record["ratios"][f"{fuelline} / {loader}"]["per_round"]) == 2
    assert (tmp_path / "results" / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "row groups/batch" in (tmp_path / "results" / "peers.md").read_text()


@pytest.mark.timeout(120)
def test_quick_heap_benchmark_reads_each_pass_in_a_process_with_the_heap_it_names(tmp_path: Path) -> None:
    _run_quick("heap", tmp_path, 100)
    record = _record(tmp_path, "heap")
    kinds = ("bare pyzmq", "fuelline", "fuelline, fresh_arrays")
    assert set(record["contenders"]) == {f"{k}, {h}" for k in kinds for h in ("glibc's defaults", "fuelline's heap")}
    for name, entry in record["contenders"].items():
        assert len(entry["rounds"]) == 2 and all(r["batches"] == 20 and r["faults"] >= 0 for r in entry["rounds"]), name
        assert entry["GB/s"]["median"] > 0 and entry["receiver CPU ms/batch"]["median"] > 0, name
        assert entry["receiver peak RSS MB"]["median"] > 0, name
    assert "fuelline, fuelline's heap / fuelline, glibc's defaults (page faults/batch)" in record["ratios"]
