"""A host name that does not resolve is told as such, naming the host, not as a refused
connection (libzmq retries both alike). The name is looked up only once connections fail: a
client that reaches its server by name makes no lookup of its own.

``.invalid`` names never resolve (RFC 6761).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import ServerUnavailable

CLI = [sys.executable, "-m", "fuelline.server.cli"]
NOWHERE = "no-such-data-server.invalid"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_name_that_does_not_resolve_is_named_as_such(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fuelline.client")
    start = time.monotonic()
    with pytest.raises(ServerUnavailable) as info:
        with ServerDataStream(host=NOWHERE, port=5557, heartbeat=0.2, timeout=30.0, connect_timeout=1.5) as s:
            next(iter(s.get_epoch_iterator()))
    waited = time.monotonic() - start
    message = str(info.value)
    assert f"the host name {NOWHERE} does not resolve" in message and "refused" not in message, message
    # Still retried for connect_timeout, as a refusal is: a name may appear (a pod's DNS record
    # is made once the pod is), and the client connects then.
    assert 1.5 <= waited < 1.5 + 2.0, f"gave up after {waited:.1f}s, not connect_timeout"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"{NOWHERE} does not resolve" in w for w in warnings), warnings
    assert not any("refuses connections" in w for w in warnings), warnings


def test_the_cli_names_the_host_that_does_not_resolve() -> None:
    out = subprocess.run([*CLI, "stream", f"{NOWHERE}:5557", "--connect-timeout", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("fuelline stream: error:") and f"the host name {NOWHERE} does not resolve" in last, out.stderr
    assert "refused" not in last, out.stderr


def test_a_name_that_resolves_and_refuses_is_still_a_refusal() -> None:
    port = free_port()
    with pytest.raises(ServerUnavailable) as info:
        with ServerDataStream(host="localhost", port=port, heartbeat=0.2, timeout=30.0, connect_timeout=1.5) as s:
            next(iter(s.get_epoch_iterator()))
    message = str(info.value)
    assert f"connection refused: nothing listens at localhost:{port}" in message, message
    assert "does not resolve" not in message, message


def test_a_client_that_reaches_its_server_by_name_makes_no_lookup(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "500")
    with ServerDataStream(("sample_id",), host="localhost", port=server.port, local=False, timeout=20) as s:
        rows = sum(len(b[0]) for b in s.get_epoch_iterator())
        watch = s._conns[0]._watch  # noqa: SLF001 (where a lookup would be kept)
        assert watch._lookup is None  # noqa: SLF001
    assert rows == 8000
