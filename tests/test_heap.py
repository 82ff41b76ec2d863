"""A reader keeps the C heap's freed receive buffers for the batches to come (fuelline.client.heap).

libzmq receives every message into a buffer of its own, and glibc gave the freed ones back to the
kernel in bursts, so the next batches faulted their pages in again. Each reader runs in a process of
its own: malloc's thresholds are the process's, and are only ever raised.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fuelline.client import heap

BATCH = (1024, 1024)  # float32: 4 MiB a batch
BATCHES = 240
HWM = 10

SERVER = """
import numpy as np
from fuelline.server import start_server

class Repeated:
    sources = ("features",)
    def __init__(self):
        self.array = np.ones({shape!r}, dtype=np.float32)
    def get_epoch_iterator(self, **kwargs):
        return ((self.array,) for _ in range({batches}))

start_server(Repeated(), port=0, hwm={hwm}, host="127.0.0.1", fresh_arrays=True)
"""

READER = """
import os, sys
from fuelline.client import ServerDataStream, heap

def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

endpoints = sys.argv[1].split(",")
local = sys.argv[2] == "local"
with ServerDataStream(("features",), endpoints=endpoints, hwm=int(sys.argv[3]), timeout=30, local=local) as stream:
    counted = 0
    for i, (features,) in enumerate(stream.get_epoch_iterator()):
        assert features[-1, -1] == 1.0
        if i == 80:
            start = faults()
        elif i > 80:
            counted += 1
    print("faults_per_batch", (faults() - start) / counted)
    print("pages_per_batch", features.nbytes // os.sysconf("SC_PAGE_SIZE"))
    print("transport", stream.transports[0])
print("held", heap.held())
print("why", heap.why_left_alone())
"""


@pytest.fixture
def endpoints(start_script) -> list[str]:
    return [start_script(SERVER.format(shape=BATCH, batches=BATCHES, hwm=HWM)).endpoint for _ in range(2)]


def read(tmp_path: Path, endpoints: list[str], *, local: bool = False, hwm: int = HWM, **env: str) -> dict[str, str]:
    """Read an epoch of every server in a process of its own; what it printed, by first word."""
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(READER))
    environ = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES}
    environ.pop("FUELLINE_HEAP", None)
    environ.update(env)
    done = subprocess.run([sys.executable, str(script), ",".join(endpoints), "local" if local else "tcp", str(hwm)],
                          capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_a_reader_over_tcp_keeps_freed_buffers_for_what_its_connections_may_hold_and_reuses_their_pages(
    tmp_path: Path, endpoints: list[str]
) -> None:
    out = read(tmp_path, endpoints)
    assert out["transport"].startswith("tcp://"), out
    # Twice what its connections may hold together: the reader's hwm, shared between its two
    # servers (5 each), of their largest message (a batch and its header).
    in_flight = HWM * BATCH[0] * BATCH[1] * 4
    assert 2 * in_flight <= int(out["held"]) <= 2 * (in_flight + HWM * 4096), out
    assert out["why"] == "None", out
    # Its pages are reused, not faulted in again (with glibc's defaults, 10 to 30 % of them were).
    assert float(out["faults_per_batch"]) < 0.05 * int(out["pages_per_batch"]), out


@pytest.mark.parametrize("variable, value, why", [
    ("FUELLINE_HEAP", "system", "FUELLINE_HEAP=system"),
    ("MALLOC_TRIM_THRESHOLD_", "1048576", "MALLOC_TRIM_THRESHOLD_ is set"),
    ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536", "GLIBC_TUNABLES sets glibc.malloc"),
])
def test_a_reader_leaves_the_heap_to_a_user_who_chose(tmp_path: Path, endpoints: list[str], variable: str, value: str,
                                                       why: str) -> None:
    out = read(tmp_path, endpoints[:1], **{variable: value})
    assert out["held"] == "0" and out["why"] == why, out


def test_a_reader_on_the_servers_host_whose_batches_come_in_shared_memory_leaves_the_heap_alone(
    tmp_path: Path, endpoints: list[str]
) -> None:
    out = read(tmp_path, endpoints[:1], local=True)
    assert out["transport"].startswith("ipc://"), out
    assert out["held"] == "0" and out["why"] == "None", out


def test_a_reader_of_batches_smaller_than_glibcs_first_mmap_threshold_leaves_the_heap_alone(
    tmp_path: Path, start_script
) -> None:
    # 64 KiB batches: never mapped and unmapped by glibc, however many are held (here 16, 1 MiB).
    small = start_script(SERVER.format(shape=(64, 256), batches=BATCHES, hwm=16)).endpoint
    out = read(tmp_path, [small], hwm=16)
    assert out["transport"].startswith("tcp://"), out
    assert out["held"] == "0" and out["why"] == "None", out


def test_what_leaves_the_heap_alone_is_named() -> None:
    assert heap.left_alone({}) is None
    assert heap.left_alone({"FUELLINE_HEAP": "tuned"}) is None
    assert heap.left_alone({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None
    assert heap.left_alone({"MALLOC_TOP_PAD_": "0"}) == "MALLOC_TOP_PAD_ is set"
    assert heap.left_alone({"MALLOC_MMAP_MAX_": "0"}) == "MALLOC_MMAP_MAX_ is set"
    assert heap.left_alone({"FUELLINE_HEAP": "system", "MALLOC_TOP_PAD_": "0"}) == "FUELLINE_HEAP=system"


FORKED = f"""
import os, sys
from fuelline.client import ServerDataStream, heap

with ServerDataStream(("features",), endpoints=[sys.argv[1]], hwm={HWM}, timeout=30, local=False) as stream:
    batches = stream.get_epoch_iterator()
    next(batches)
    parent_held = heap.held()
    assert parent_held > 0 and len(heap._windows) == 1
    # A thread of the parent holds the lock as it forks (a reader's keep-alive thread might).
    heap._lock.acquire()
    pid = os.fork()
    if pid == 0:
        ok = heap.held() == parent_held and not heap._windows and heap._lock.acquire(timeout=5)
        os._exit(0 if ok else 1)
    heap._lock.release()
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_reader_keeps_the_thresholds_but_not_its_parents_connections_or_lock(tmp_path: Path,
                                                                                       endpoints: list[str]) -> None:
    script = tmp_path / "forked.py"
    script.write_text(textwrap.dedent(FORKED))
    environ = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES and k != "FUELLINE_HEAP"}
    done = subprocess.run([sys.executable, str(script), endpoints[0]], capture_output=True, text=True, timeout=120,
                          env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child 0" in done.stdout, done.stdout + done.stderr[-3000:]


LIAR = """
import sys
import numpy as np
import zmq
from fuelline.client import ServerDataStream, heap
from fuelline.protocol import Batch, Hello, ProtocolError, Welcome, decode, encode

honest = sys.argv[1] == "honest"
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
port = router.bind_to_random_port("tcp://127.0.0.1")
with ServerDataStream(("x",), endpoints=[f"127.0.0.1:{port}"], timeout=10.0, local=False) as stream:
    batches = stream.get_epoch_iterator()  # connects and says Hello
    assert router.poll(10000), "no Hello"
    rid, *frames = router.recv_multipart()
    hello = decode(frames)
    assert isinstance(hello, Hello)
    welcome = Welcome("s", hello.stream, ("x",), {"x": {"dtype": "<f4", "shape": []}}, 1, 1.0)
    header, array = encode(Batch(hello.stream, 0, 0, {"x": np.zeros(1 << 20, dtype="<f4")}), checksum=False)
    if not honest:
        array = bytes(len(array) + 4)  # four bytes more than its header says
    router.send_multipart([rid, *encode(welcome)])
    router.send_multipart([rid, header, array])
    try:
        print("rows", len(next(batches)[0]))
    except ProtocolError as exc:
        print("error", exc)
print("held", heap.held())
router.close(0)
ctx.term()
"""


@pytest.mark.parametrize("server", ["honest", "lying"])
def test_only_a_message_read_as_the_servers_sizes_the_heap(tmp_path: Path, server: str) -> None:
    script = tmp_path / "liar.py"
    script.write_text(textwrap.dedent(LIAR))
    environ = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES and k != "FUELLINE_HEAP"}
    done = subprocess.run([sys.executable, str(script), server], capture_output=True, text=True, timeout=60, env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    if server == "honest":
        assert out.get("rows") == str(1 << 20) and int(out["held"]) >= heap.TRIM_FLOOR, out
    else:
        assert "frame holds" in out.get("error", "") and out["held"] == "0", out


def test_a_mistyped_fuelline_heap_is_named_in_a_warning_and_changes_nothing(caplog) -> None:
    with caplog.at_level("WARNING", logger="fuelline.client"):
        assert heap.left_alone({"FUELLINE_HEAP": "sytem"}) is None
    assert any("FUELLINE_HEAP='sytem'" in r.getMessage() and "'system'" in r.getMessage() for r in caplog.records), \
        caplog.text
