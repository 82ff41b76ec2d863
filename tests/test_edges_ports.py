"""Ports outside 1..65535 are refused wherever a port is taken, naming the option or argument and
the value: libzmq read ``--port 70000`` as 4464, and the server said it served on 70000."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.endpoints import parse_host_port, tcp_endpoint
from fuelline.server import ParquetSource, Server
from fuelline.trainer.cli import parse_args

CLI = [sys.executable, "-m", "fuelline.server.cli"]
OUT_OF_RANGE = ["70000", "65536", "-1"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout)


def assert_refused(out: subprocess.CompletedProcess, command: str, option: str, value: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "serving on" not in out.stdout and "Traceback" not in out.stderr, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{command}: error:"), out.stderr
    assert option in last and value in last and "65535" in last, last


@pytest.mark.parametrize("value", OUT_OF_RANGE)
@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_serve_refuses_a_port_out_of_range(sample_dataset: Path, option: str, value: str) -> None:
    out = run(*CLI, "serve", str(sample_dataset), option, value)
    assert_refused(out, "fuelline serve", option, value)


def test_serve_port_0_still_picks_a_free_one(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--metrics-port", "0")  # (start_serve passes --port 0)
    assert 0 < server.port <= 65535


@pytest.mark.parametrize("endpoint", ["127.0.0.1:70000", "127.0.0.1:0", "localhost:65536"])
def test_stream_refuses_a_port_out_of_range_in_one_line(endpoint: str) -> None:
    out = run(*CLI, "stream", endpoint, "--connect-timeout", "1", "--timeout", "1")
    assert_refused(out, "fuelline stream", repr(endpoint), endpoint.rpartition(":")[2])


@pytest.mark.parametrize("servers", ["127.0.0.1:70000", "127.0.0.1:5557,127.0.0.1:0"])
def test_the_trainer_refuses_a_server_port_out_of_range(servers: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--servers", servers])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    bad = servers.split(",")[-1]
    assert "--servers" in last and repr(bad) in last and "1..65535" in last, last


def test_the_trainer_takes_servers_without_loading_the_server_package() -> None:
    code = ("import sys; from fuelline.trainer.cli import parse_args; parse_args(['--servers', 'h:5557']); "
            "print(sorted(m for m in sys.modules if m.startswith('fuelline.server')))")
    out = run(sys.executable, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("port", [70000, 65536, -1, 0, True, "http", 5557.0])
def test_server_data_stream_refuses_a_port_out_of_range(port: object) -> None:
    with pytest.raises(OptionError) as info:
        ServerDataStream(port=port, timeout=1.0)
    assert str(info.value) == f"port must be a TCP port in 1..65535, got {port!r}"


@pytest.mark.parametrize("endpoint", ["localhost:70000", "localhost:0", "[::1]:65536"])
def test_server_data_stream_refuses_an_endpoint_port_out_of_range(endpoint: str) -> None:
    with pytest.raises(OptionError) as info:
        ServerDataStream(endpoints=["localhost:5557", endpoint], timeout=1.0)
    assert info.value.option == "endpoints" and repr(endpoint) in str(info.value) and "1..65535" in str(info.value)


def test_server_refuses_a_port_out_of_range(sample_dataset: Path) -> None:
    source = ParquetSource(str(sample_dataset), batch_size=1000)
    try:
        for port in (70000, -1):
            with pytest.raises(DataError, match=rf"^port must be a TCP port in 0\.\.65535 \(0 picks a free one\), got {port}$"):
                Server(source, port=port)
    finally:
        source.close()


def test_start_server_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    # In a process of its own: the code as it was would serve (on port 4464) until killed.
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from fuelline.protocol import DataError
        from fuelline.server import start_server

        class Stream:
            sources = ("x",)

            def get_epoch_iterator(self, **kwargs):
                return iter([(np.zeros(3),)])

        try:
            start_server(Stream(), port=70000)
        except DataError as exc:
            print(f"refused: {exc}")
    """))
    out = run(sys.executable, str(script), timeout=60)
    assert out.stdout.strip() == "refused: port must be a TCP port in 0..65535 (0 picks a free one), got 70000", (
        out.stdout + out.stderr)


def test_the_shared_check() -> None:
    from fuelline.protocol.common.ports import check_port

    assert check_port(5557, "port") == 5557 and check_port(np.int32(80), "port") == 80
    assert check_port("5557", "port") == 5557  # (Fuel put the port into a string; a string of digits still works)
    assert check_port(0, "port", free=True) == 0
    with pytest.raises(OptionError, match=r"^metrics_port must be a TCP port in 1\.\.65535, got 0$"):
        check_port(0, "metrics_port")
    assert parse_host_port("[::1]:65535") == ("::1", 65535)
    assert tcp_endpoint("::1:5557") == "tcp://[::1]:5557"
    with pytest.raises(ValueError, match=r"^endpoint 'h:²' is not HOST:PORT$"):  # (still a ValueError)
        parse_host_port("h:²")
    with pytest.raises(OptionError, match=r"^--servers 'h:70000' has port 70000; a port must be in 1\.\.65535$"):
        parse_host_port("h:70000", "--servers")
