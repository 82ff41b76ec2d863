"""A refused connection (nothing listens at the port) is told as such and given up on after
``connect_timeout``; a server that accepts and stays silent, or one welcomed once that restarts,
still gets the whole ``timeout``."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import ServerUnavailable

from support.processes import ServerProcess, wait_until

ARGS = ("--batch-size", "40", "--heartbeat", "0.2", "--seed", "11")


def free_port() -> int:
    """A port nothing listens on (bound a moment, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_nothing_listening_fails_after_connect_timeout_and_says_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fuelline.client")
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ServerUnavailable) as info:
        with ServerDataStream(host="127.0.0.1", port=port, heartbeat=0.2, timeout=30.0, connect_timeout=1.5) as s:
            next(iter(s.get_epoch_iterator()))
    waited = time.monotonic() - start
    assert 1.5 <= waited < 1.5 + 2.0, f"gave up after {waited:.1f}s, not connect_timeout"
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "refused" in message, message
    # Told once, as a refusal; the reconnects it makes meanwhile are no warning each.
    assert len(warnings_of(caplog, "refuses connections")) == 1, caplog.text
    assert warnings_of(caplog, "silent for") == [], caplog.text


def test_a_silent_server_is_not_a_refused_one(zmq_context: zmq.Context) -> None:
    # Accepts the connection and the handshake, never answers a Hello: that is a silent server,
    # waited for up to timeout, not connect_timeout.
    router = zmq_context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        start = time.monotonic()
        with pytest.raises(ServerUnavailable) as info:
            with ServerDataStream(host="127.0.0.1", port=port, heartbeat=0.2, timeout=3.0, connect_timeout=0.5) as s:
                next(iter(s.get_epoch_iterator()))
        waited = time.monotonic() - start
    finally:
        router.close(linger=0)
    assert 3.0 <= waited < 3.0 + 2.0, f"gave up after {waited:.1f}s, not timeout"
    assert "refused" not in str(info.value), str(info.value)


def test_the_cli_names_the_refused_endpoint() -> None:
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "stream", f"127.0.0.1:{port}", "--connect-timeout", "1"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("fuelline stream: error:") and f"127.0.0.1:{port}" in last and "refused" in last, out.stderr
    assert out.stderr.count("refuses connections") == 1 and "silent for" not in out.stderr, out.stderr


def test_a_server_welcomed_once_is_waited_for_past_connect_timeout(
    sample_dataset: Path, start_serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fuelline.client")
    server = start_serve(sample_dataset, *ARGS)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=20) as s:
        expected = [b[0].tolist() for b in s.get_epoch_iterator()]
    connect_timeout = 0.5
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=4, heartbeat=0.2, timeout=30,
                          connect_timeout=connect_timeout) as s:
        it = s.get_epoch_iterator()
        seen = [next(it)[0].tolist() for _ in range(30)]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        killed = time.monotonic()
        # The keep-alive thread reconnects meanwhile and meets refused connections...
        wait_until(lambda: warnings_of(caplog, "refuses connections"), 10, "the client saw its server refuse")
        # ... for several times connect_timeout: the outage this test is about.
        wait_until(lambda: time.monotonic() - killed > 4 * connect_timeout, 10, "an outage past connect_timeout")
        port = int(server.endpoint.rpartition(":")[2])
        again = ServerProcess([sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port",
                               str(port), *ARGS], tmp_path / "restarted.log")
        try:
            seen += [b[0].tolist() for b in it]
        finally:
            again.close()
    assert seen == expected


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_server_on_an_ipv6_address_is_reached_by_its_clients(sample_dataset: Path, start_serve, processes: str) -> None:
    server = start_serve(sample_dataset, *ARGS, "--host", "::1", "--processes", processes)
    with ServerDataStream(("sample_id",), endpoints=[f"[::1]:{server.port}"], local=False, timeout=20,
                          connect_timeout=5) as s:
        rows = sum(len(b[0]) for b in s.get_epoch_iterator())
    assert rows == 8000
