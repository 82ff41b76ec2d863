"""The bed of hosts and links (benchmarks/bed.py): hosts reach each other by address and nothing
else, a link's rate limit holds, a partition is silence until healed, CPU sets apply, and closing
removes everything, processes included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.bed import Bed, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

SINK = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 5001))
s.listen()
print("ready", flush=True)
conn, _ = s.accept()
n = 0
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    n += len(data)
print(n, flush=True)
"""


def _connect(bed: Bed, index: int, address: str, port: int = 5999, timeout: float = 1.0) -> str:
    """What a TCP connect from host ``index`` gets: 'refused' (reached a host), 'timeout' (silence,
    or no answer to ARP: EHOSTUNREACH) or another error."""
    code = (f"import socket\ntry:\n    socket.create_connection(({address!r}, {port}), timeout={timeout})\n"
            f"    print('connected')\nexcept ConnectionRefusedError:\n    print('refused')\n"
            f"except (TimeoutError, OSError) as e:\n    print('timeout' if isinstance(e, TimeoutError) or e.errno == 113 else e)")
    done = subprocess.run(bed.hosts[index].command([sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=30)
    return done.stdout.strip()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_by_address_and_not_the_machines_loopback() -> None:
    with Bed(3) as bed:
        addresses = [h.address for h in bed.hosts]
        assert len(set(addresses)) == 3
        assert _connect(bed, 1, addresses[0]) == "refused"  # a host answered: nothing listens there
        assert _connect(bed, 2, addresses[1]) == "refused"
        # The machine's own services are out of reach: a host's loopback is its own.
        assert _connect(bed, 0, "127.0.0.1", 22) == "refused"


@pytest.mark.timeout(120)
def test_a_rate_limited_link_carries_no_more_than_its_rate() -> None:
    # 4 MB at 20 Mbit/s take 1.6 s at the least; a bucket of 64 KiB lets through a few ms more.
    size, rate_bits = 4_000_000, 20e6
    with Bed(2, rate="20mbit") as bed:
        sink = subprocess.Popen(bed.hosts[0].command([sys.executable, "-c", SINK]), stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
            started = time.perf_counter()
            send = (f"import socket\ns = socket.create_connection(({bed.hosts[0].address!r}, 5001), timeout=60)\n"
                    f"s.sendall(b'x' * {size})\ns.close()")
            subprocess.run(bed.hosts[1].command([sys.executable, "-c", send]), check=True, timeout=60)
            assert int(sink.stdout.readline()) == size
            elapsed = time.perf_counter() - started
        finally:
            sink.kill()
            sink.wait(30)
    assert elapsed >= 0.9 * size * 8 / rate_bits, elapsed


@pytest.mark.timeout(120)
def test_a_partition_is_silence_until_healed() -> None:
    with Bed(2) as bed:
        bed.partition(1)
        assert _connect(bed, 1, bed.hosts[0].address) == "timeout"
        assert _connect(bed, 0, bed.hosts[1].address) == "timeout"
        bed.heal(1)
        # The link comes back within a moment (the port's carrier, then ARP).
        deadline = time.monotonic() + 15
        while (got := _connect(bed, 1, bed.hosts[0].address)) != "refused" and time.monotonic() < deadline:
            pass  # each try waits up to its own 1 s connect timeout
        assert got == "refused"


@pytest.mark.timeout(120)
def test_a_host_runs_on_its_cpus() -> None:
    with Bed(1, cpus=["0"]) as bed:
        done = subprocess.run(bed.hosts[0].command([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]),
                              capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == "[0]"


@pytest.mark.timeout(120)
def test_closing_removes_namespaces_and_the_processes_left_in_them() -> None:
    bed = Bed(2)
    with bed:
        left = subprocess.Popen(bed.hosts[1].command([sys.executable, "-c", "import time; time.sleep(600)"]))
        names = [h.namespace for h in bed.hosts] + [bed.switch]
        assert all(name in _namespaces() for name in names)
    assert left.wait(timeout=30) is not None  # killed by the close
    assert not any(name in _namespaces() for name in names)


@pytest.mark.timeout(120)
def test_memory_files_are_shared_within_a_host_and_not_across_hosts() -> None:
    def run(bed: Bed, host: int, code: str) -> str:
        return subprocess.run(bed.hosts[host].command([sys.executable, "-c", code]), capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    write = "import os, tempfile; print(tempfile.gettempdir()); open('/dev/shm/fl-bed-probe', 'w').write('x')"
    look = "import os; print(os.path.exists('/dev/shm/fl-bed-probe'))"
    with Bed(2) as bed:
        assert run(bed, 0, write) == "/dev/shm"  # TMPDIR: the host's own memory file system
        assert run(bed, 0, look) == "True"  # a later process of the same host sees it
        assert run(bed, 1, look) == "False"  # another host does not
    assert not os.path.exists("/dev/shm/fl-bed-probe")  # nor does the machine


@pytest.mark.timeout(120)
def test_a_command_runs_in_the_callers_working_directory(tmp_path: Path) -> None:
    with Bed(1) as bed:
        done = subprocess.run(bed.hosts[0].command([sys.executable, "-c", "import os; print(os.getcwd())"]),
                              cwd=tmp_path, capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == str(tmp_path)


@pytest.mark.parametrize("rate", ["1gbt", "gbit", "0mbit", "-1gbit", "fast"])
def test_a_rate_tc_cannot_take_is_refused_by_name_before_anything_is_built(rate: str) -> None:
    from benchmarks.bed import check_rate

    with pytest.raises(ValueError, match=repr(rate)):
        check_rate(rate)
    before = _namespaces()
    with pytest.raises(ValueError, match=repr(rate)):
        Bed(1, rate=rate)
    assert _namespaces() == before  # nothing was built
