"""Seeded fault schedules against a real ``fuelline serve`` and real clients (tests/support/fault_schedule.py).

DESIGN.md promises, under Semantics: exactly-once delivery across a server's kill -9 and restart
and across resumes from ``state_dict`` at any point and on any world size; a restart with other
options, or with a shard's content swapped under the same name, size and mtime, raised as an
error, never served silently; a server's memory and threads bounded whatever peers send; a user
stage of seconds a batch slows only its own batches, and one that hangs does not keep SIGTERM
from ending the server; honest clients complete. Each seed below draws a schedule of those faults and
the run checks all of it at once; a failure prints the seed and the schedule, and
``cd tests && python -m support.fault_schedule --seed N --steps 6`` replays it. The proxy the faults go through
is tested on its own first, so that a schedule's failure is the system's and not the harness's.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from support.fault_schedule import KINDS, make_schedule, run_schedule
from support.processes import wait_until
from support.tcp_proxy import TcpProxy

# Fault kinds the schedules draw from. All are on: kill, other-options, pause, cut, delay, stall,
# silent-peers, hostile-peers, resume, resume-resized, resume-epoch-end, slow-stage, hanging-stage,
# shard-swap (see fault_schedule.py).
KINDS_ON = KINDS
STEPS = 6
# Fixed seeds whose schedules together draw every kind that is on (checked below): 0 hangs the
# stage and SIGTERMs the server mid-epoch, then swaps a shard before a restart; 1 hangs it just
# as the next fault is due; 6 kills the server twice between resumes on other world sizes; 50
# runs worker processes and slows train and val batches to 1.4 s (a val reader beside them),
# then restarts with another batch size.
SEEDS = (0, 1, 6, 50)
WAIT = 5.0  # seconds any socket operation in the proxy tests may take


def test_the_seeds_draw_every_kind_that_is_on() -> None:
    drawn = set()
    for seed in SEEDS:
        schedule = make_schedule(seed, STEPS, KINDS_ON)
        drawn |= {f.kind for f in schedule.faults} | {s.kind for s in schedule.stops}
    assert drawn == set(KINDS_ON), f"no seed draws {sorted(set(KINDS_ON) - drawn)}"
    assert any(make_schedule(seed, STEPS, KINDS_ON).options.workers for seed in SEEDS)
    assert any(f.kind == "slow-stage" and "val" in f.change[1] for seed in SEEDS
               for f in make_schedule(seed, STEPS, KINDS_ON).faults), "no seed slows the val split"


def test_a_schedule_is_a_function_of_its_seed() -> None:
    assert make_schedule(57, STEPS) == make_schedule(57, STEPS)
    assert make_schedule(57, STEPS).describe() != make_schedule(58, STEPS).describe()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_fault_schedule_loses_and_repeats_nothing_and_stays_bounded(seed: int, tmp_path: Path) -> None:
    schedule = make_schedule(seed, STEPS, KINDS_ON)
    outcome = run_schedule(schedule, tmp_path / "run", deadline=100.0)
    assert outcome.ok, outcome.report()
    # A fault that never fired tested nothing: each is due well before the readers finish.
    assert len(outcome.fired) == len(schedule.faults), outcome.report()


# -- the proxy ------------------------------------------------------------------------------------
class Echo:
    """A loopback TCP server that sends back what it receives, one thread per connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        with conn:
            while not self.stop.is_set():
                try:
                    data = conn.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        self.listener.close()


@pytest.fixture
def echo_proxy():
    echo = Echo()
    proxy = TcpProxy(echo.port, lifetime=60.0)
    yield proxy
    proxy.close()
    echo.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    sock.settimeout(WAIT)
    return sock


def test_proxy_forwards_and_a_cut_resets_every_connection_but_not_the_next(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy.port) as a, connect(echo_proxy.port) as b:
        for sock in (a, b):
            sock.sendall(b"ping")
            assert sock.recv(16) == b"ping"
        assert echo_proxy.cut() == 2
        for sock in (a, b):
            try:
                assert sock.recv(16) == b""
            except ConnectionResetError:
                pass
    with connect(echo_proxy.port) as c:
        c.sendall(b"again")
        assert c.recv(16) == b"again"


def test_proxy_cut_in_flight_loses_the_chunk_it_meets(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy.port) as sock:
        sock.sendall(b"before")
        assert sock.recv(16) == b"before"
        cuts: list[int] = []
        cutter = threading.Thread(target=lambda: cuts.append(echo_proxy.cut(in_flight=True, within=WAIT)))
        cutter.start()
        wait_until(lambda: echo_proxy.armed, WAIT, "the cut waits for the server's next chunk")
        sock.sendall(b"lost")  # reaches the echo server; its answer is the chunk the cut meets
        cutter.join(WAIT)
        assert cuts == [1]
        try:
            assert sock.recv(16) == b""
        except ConnectionResetError:
            pass


def test_proxy_stall_holds_the_bytes_until_resume(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy.port) as sock:
        echo_proxy.stall()
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            sock.recv(16)  # nothing passes while stalled (half a second is the check, not a wait for it)
        sock.settimeout(WAIT)
        echo_proxy.resume()
        assert sock.recv(16) == b"held"


def test_proxy_delay_holds_each_chunk_that_long(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy.port) as sock:
        echo_proxy.delay(0.2)
        start = time.monotonic()
        sock.sendall(b"slow")
        assert sock.recv(16) == b"slow"
        assert time.monotonic() - start >= 0.4  # held once on the way there and once on the way back
        echo_proxy.resume()
        start = time.monotonic()
        sock.sendall(b"fast")
        assert sock.recv(16) == b"fast"
        assert time.monotonic() - start < 0.4


def test_proxy_stops_by_itself_after_its_lifetime() -> None:
    echo = Echo()
    try:
        proxy = TcpProxy(echo.port, lifetime=0.5)
        with connect(proxy.port) as sock:
            sock.sendall(b"x")
            assert sock.recv(16) == b"x"
            try:
                assert sock.recv(16) == b""  # closed by the proxy when its lifetime ends
            except ConnectionResetError:
                pass
        proxy.close()
        with pytest.raises(OSError):
            connect(proxy.port).close()
    finally:
        echo.close()
