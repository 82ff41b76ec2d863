"""The server's Prometheus endpoint, scraped over HTTP while clients stream and after."""

from __future__ import annotations

from pathlib import Path

from fuelline.client import ServerDataStream

from support.metrics import metrics_port, scrape

TIMEOUT = 20.0


def test_scrape_counts_what_clients_received(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100", "--metrics-port", "0", "--hwm", "4")
    port = metrics_port(server)
    before = scrape(port)
    assert before[("fuelline_batches_sent_total", ())] == 0
    assert before[("fuelline_clients_connected", ())] == 0
    with ServerDataStream(("sample_id", "features"), endpoints=[server.endpoint], hwm=4, timeout=TIMEOUT,
                          client_id="scraped") as s:
        it = s.get_epoch_iterator()
        first = next(it)
        during = scrape(port)
        # The client holds its hwm: what it granted and what is in flight add up to at most 4.
        assert during[("fuelline_clients_connected", ())] == 1
        mine = [k for k in during if k[0] == "fuelline_client_in_flight"]
        assert len(mine) == 1 and ("rank", "0") in mine[0][1] and ("split", "train") in mine[0][1]
        assert 0 <= during[mine[0]] <= 4
        rest = list(it)
        nbytes = sum(a.nbytes for b in [first, *rest] for a in b)
        batches = 1 + len(rest)
    after = scrape(port)
    assert batches == 80  # 8000 train rows in batches of 100
    assert after[("fuelline_batches_sent_total", ())] >= batches
    assert after[("fuelline_sent_bytes_total", ())] >= nbytes
    # A client on the server's host reads its batches from shared memory, when /dev/shm can hold them.
    from fuelline.server.serving.local_ipc import default_base, on_memory_fs
    shared = after[("fuelline_batches_shared_total", ())]
    assert shared >= batches - 2 * 4 - 1 if on_memory_fs(default_base()) else shared == 0
    assert after[("fuelline_cache_misses_total", (("tier", "memory"),))] >= batches
    assert after[("fuelline_workers_configured", ())] == 0
    assert after[("fuelline_malformed_messages_total", ())] == 0


def test_windows_dropped_by_reason_are_exported(tmp_path: Path, start_serve) -> None:
    from fuelline.server.ingest.convert import convert
    from fuelline.server.ingest.synth import synthesize

    synthesize(str(tmp_path / "raw"), 4, 12.0, 1, video_dim=4, drop=0.02)
    convert(str(tmp_path / "raw"), str(tmp_path / "data"), progress=False)
    server = start_serve(tmp_path / "data", "--batch-size", "8", "--metrics-port", "0")
    samples = scrape(metrics_port(server))
    dropped = {dict(labels)["reason"]: v for (name, labels), v in samples.items() if name == "fuelline_windows_dropped"}
    log = server.log()
    assert dropped, "a synthetic recording with drops and shifted clocks has invalid windows"
    for reason, n in dropped.items():
        assert n > 0 and reason in log  # the same reasons the start-up line names


def test_a_taken_metrics_port_is_a_clear_error(sample_dataset: Path, tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port", "0",
                              "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--metrics-port: cannot listen on 127.0.0.1:{port}" in out.stderr


def test_json_logs_are_one_object_per_line(sample_dataset: Path, start_serve) -> None:
    import json

    server = start_serve(sample_dataset, "--log-format", "json", "--status-interval", "0.2")
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        sum(1 for _ in s.get_epoch_iterator())
    server.wait_log(r'"message": "\d+ clients; ')
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["message"].startswith("split 'train'") and r["level"] == "INFO" for r in records)


def test_worker_processes_are_exported(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "500", "--workers", "1", "--metrics-port", "0")
    port = metrics_port(server)
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        batches = sum(1 for _ in s.get_epoch_iterator())
    samples = scrape(port)
    assert batches == 16
    assert samples[("fuelline_workers_configured", ())] == 1
    assert samples[("fuelline_workers_alive", ())] == 1
    assert samples[("fuelline_worker_tasks_total", ())] >= 16  # every row group of the train split
    assert samples[("fuelline_worker_restarts_total", ())] == 0
