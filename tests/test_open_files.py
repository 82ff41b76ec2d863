"""Open files: a server or a reader raises its soft limit for what it may hold, and one that runs
out says so instead of going quiet.

Past the limit, libzmq cannot accept a connection and retries at once, for ever: a server's I/O
thread spins a core, and the clients it never accepted hear nothing but silence, which they blame
on the server. Each test runs the side under a limit in a process of its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zmq

from fuelline.client import ServerDataStream

TIMEOUT = 30.0


def serve_under(start_script, dataset: Path, soft: int, hard: int, *options: str):
    """``fuelline serve DATASET`` in a process whose limit on open files is (soft, hard)."""
    return start_script(f"""
        import resource, sys
        from fuelline.server.cli.main import main
        resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
        sys.exit(main(["serve", {str(dataset)!r}, "--port", "0", "--status-interval", "0", *{list(options)!r}]))
        """)


def limits_of(pid: int) -> tuple[int, int]:
    text = Path(f"/proc/{pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)", text).groups()
    return int(soft), int(hard)


def test_a_server_raises_its_soft_limit_for_its_max_clients_and_says_so(sample_dataset: Path, start_script) -> None:
    server = serve_under(start_script, sample_dataset, 128, 4096, "--max-clients", "300")
    log = server.wait_log(r"raised this process's limit on open files from 128 to \d+, for up to 300 clients")
    soft, hard = limits_of(server.proc.pid)
    # A client on the Unix socket keeps two connections, and one more for those not yet sessions.
    assert 64 + 3 * 300 <= soft <= hard == 4096, (soft, hard)
    assert f"to {soft}," in log
    assert "may need" not in log  # (room enough: no warning)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
        assert len(next(iter(stream.get_epoch_iterator()))[0]) > 0


def test_a_server_whose_hard_limit_is_short_of_its_max_clients_warns_at_start_and_when_files_run_out(
    sample_dataset: Path, start_script, zmq_context: zmq.Context
) -> None:
    server = serve_under(start_script, sample_dataset, 96, 96, "--max-clients", "100", "--no-local-ipc")
    warning = server.wait_log(r"WARNING .*this process may open 96 \(hard limit 96\): up to 100 clients \(--max-clients\) "
                              r"may need \d+ more")
    assert "ulimit -n" in warning and "lower --max-clients" in warning
    # More connections than files: those beyond are never accepted, and the log says why.
    peers = []
    for _ in range(120):
        peer = zmq_context.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(f"tcp://{server.endpoint}")
        peers.append(peer)
    log = server.wait_log(r"WARNING \d+ of the 96 files this process may open are open \(hard limit 96\)", timeout=TIMEOUT)
    assert "cannot accept a connection" in log and "ulimit -n" in log
    for peer in peers:
        peer.close(linger=0)
    # With the files back, it serves again.
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT, local=False) as stream:
        assert len(next(iter(stream.get_epoch_iterator()))[0]) > 0


READER = """
import resource, sys
from fuelline.client import ServerDataStream
from fuelline.protocol.common.descriptors import open_count

endpoints = sys.argv[1].split(",")
soft, hard = (int(x) for x in sys.argv[2:4])
with ServerDataStream(("sample_id",), endpoints=endpoints[:1], timeout=30) as warm:  # (imports, the context)
    next(iter(warm.get_epoch_iterator()))
limit = open_count() + soft
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit + hard))
try:
    with ServerDataStream(("sample_id",), endpoints=endpoints, timeout=30) as stream:
        print("rows", sum(len(ids) for (ids,) in stream.get_epoch_iterator()))
except OSError as exc:
    print("error", exc)
print("limit", limit, *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def read_under(tmp_path: Path, endpoints: list[str], soft_room: int, hard_room: int) -> dict[str, str]:
    """Read an epoch from ``endpoints`` in a process left ``soft_room`` open files under its soft
    limit and ``hard_room`` more under its hard limit: what it printed, by first word."""
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(READER))
    done = subprocess.run([sys.executable, str(script), ",".join(endpoints), str(soft_room), str(hard_room)],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


@pytest.fixture
def four_servers(sample_dataset: Path, start_serve) -> list[str]:
    return [start_serve(sample_dataset, "--batch-size", "500").endpoint for _ in range(4)]


def test_a_reader_of_many_servers_raises_its_soft_limit_as_far_as_they_need(tmp_path: Path, four_servers) -> None:
    out = read_under(tmp_path, four_servers, 4, 4096)
    assert out.get("rows") == "8000", out
    limit, soft, _ = (int(x) for x in out["limit"].split())
    assert soft > limit, out


def test_a_reader_out_of_files_is_told_so_naming_the_limit_and_the_server(tmp_path: Path, four_servers) -> None:
    out = read_under(tmp_path, four_servers, 4, 0)
    limit = int(out["limit"].split()[0])
    error = out.get("error", "")
    assert "out of file descriptors" in error and f"the limit is {limit} (hard limit {limit})" in error, out
    assert re.search(r"tcp://127\.0\.0\.1:\d+", error) and "ulimit -n" in error and "about 8 a server" in error, out
