"""A client outlives its server: kill -9 and restart, or a stopped process, lose no batch."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np

from fuelline.client import ServerDataStream

from support.processes import ServerProcess, wait_until

ARGS = ("--batch-size", "40", "--heartbeat", "0.2", "--seed", "11")


def reference(endpoint: str) -> list[list[int]]:
    with ServerDataStream(("sample_id",), endpoints=[endpoint], timeout=20) as s:
        return [b[0].tolist() for e in range(2) for b in s.get_epoch_iterator()]


def restart(dataset: Path, port: int, tmp_path: Path) -> ServerProcess:
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", str(port), *ARGS]
    return ServerProcess(args, tmp_path / "restarted.log")


def test_server_killed_and_restarted_mid_epoch_loses_and_repeats_nothing(
    sample_dataset: Path, start_serve, tmp_path: Path
) -> None:
    server = start_serve(sample_dataset, *ARGS)
    expected = reference(server.endpoint)
    seen = []
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=4, heartbeat=0.2, timeout=30) as s:
        it = s.get_epoch_iterator()
        seen += [next(it)[0].tolist() for _ in range(30)]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        again = restart(sample_dataset, server.port, tmp_path)
        try:
            seen += [b[0].tolist() for b in it]
            seen += [b[0].tolist() for b in s.get_epoch_iterator()]
        finally:
            again.close()
    assert len(seen) == len(expected) == 400
    assert seen == expected
    assert np.unique(np.concatenate(seen[:200])).size == 8000


def test_stopped_server_is_noticed_and_the_stream_resumes_when_it_continues(
    sample_dataset: Path, start_serve
) -> None:
    server = start_serve(sample_dataset, *ARGS)
    expected = reference(server.endpoint)[:200]
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=4, heartbeat=0.2, timeout=30) as s:
        it = s.get_epoch_iterator()
        seen = [next(it)[0].tolist() for _ in range(50)]
        before = s.reconnects
        server.proc.send_signal(signal.SIGSTOP)
        try:
            # The server process is frozen: its heartbeats stop, and the client must notice
            # within 3 intervals (0.6 s) plus one tick of its loop.
            noticed = wait_until(lambda: s.reconnects > before, 5.0, "client noticed the stopped server")
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert noticed < 3 * 0.2 + 0.3
        seen += [b[0].tolist() for b in it]
    assert seen == expected


def test_the_reconnect_backoff_is_jittered_so_clients_dropped_together_come_back_spread_out() -> None:
    """Clients a server restart dropped in the same instant each wait between half their backoff
    and all of it, by draws of their own: a thousand of them do not come back at one moment."""
    import random

    from fuelline.client.connection import backoff_delay

    waits = [backoff_delay(0.4, random.Random()) for _ in range(1000)]
    assert min(waits) >= 0.2 and max(waits) <= 0.4
    # Spread over the range: no tenth of it holds more than a quarter of the clients.
    counts = [sum(0.2 + 0.02 * k <= w < 0.2 + 0.02 * (k + 1) for w in waits) for k in range(10)]
    assert max(counts) < 250, counts
