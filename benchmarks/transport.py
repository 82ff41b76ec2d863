"""Transport: 3 MB batches over tcp loopback (and ipc), fuelline against bare pyzmq.

Bare pyzmq is the ceiling: one preallocated array sent zero-copy over PUSH/PULL with a high-water
mark of 10, rebuilt with ``np.frombuffer`` on arrival, and nothing else; it is measured on tcp
loopback and on an ipc:// (Unix domain) socket, the two ways a co-located server can be reached.
The same bare pyzmq with an xxh3-64 of the array taken by the sender before each send and checked
by the receiver (``bare pyzmq + xxh3``) is the ceiling of any transport that checks integrity: the
least work an end-to-end checksum adds, with no protocol around it. ``bare pyzmq + copy + xxh3``
also copies each array before hashing and sending the copy, as a server of a stream that may refill
one buffer must: the ceiling for fuelline's default. fuelline sends the same
array from a Fuel-style stream through ``start_server`` to ``ServerDataStream``, adding its
headers, credit, sessions and (unless turned off) an xxh3 checksum per array, checked on arrival:
over TCP (``local=False``, as a client on another host reads), and as a default client on the
server's host reads, through the Unix socket the server offers.
The headline fuelline contenders serve the stream as ``start_server`` does by default: each batch
is copied once as it is read (and checksummed in that same pass), since a stream may refill one
buffer for every batch. The stream here yields one array it never writes to, so it may also be
served with ``fresh_arrays=True``, without the copy: those contenders are labelled so.
Each sender runs in its own process, as a data server would.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from contextlib import ExitStack
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import xxhash
import zmq

from benchmarks.common import RESULTS_DIR, Contender, Round, ServerProcess, alternate, time_batches
from benchmarks.report import Metric, RatioSpec, build_report, environment, write_results
from fuelline.client import ServerDataStream

__all__ = ["run", "serve_repeated_array", "RepeatedArrayStream"]

SHAPE = (256, 3000)
DTYPE = np.float32
HWM = 10
HOST = "127.0.0.1"
TIMEOUT_S = 60.0  # for any single wait: a connection, a batch, an acknowledgement

BARE, BARE_IPC = "bare pyzmq", "bare pyzmq, ipc"
BARE_XXH3 = "bare pyzmq + xxh3"  # the sender hashes each array, the receiver checks it: nothing else
BARE_COPY_XXH3 = "bare pyzmq + copy + xxh3"  # the same, of a copy of each array made just before
FUELLINE, NO_CHECKSUM = "fuelline", "fuelline --no-checksum"  # over TCP (ServerDataStream(local=False))
LOCAL, LOCAL_NO_CHECKSUM = "fuelline, local", "fuelline, local --no-checksum"  # the default: moves to ipc
FRESH, LOCAL_FRESH = "fuelline, fresh_arrays", "fuelline, local, fresh_arrays"  # the stream's array, not copied
FRESH_NO_CHECKSUM = "fuelline, fresh_arrays --no-checksum"  # over TCP: the protocol alone, no copy, no checksum


def make_array() -> np.ndarray:
    """The one array every batch carries: random, so nothing on the way can compress it."""
    return np.random.default_rng(0).random(SHAPE, dtype=DTYPE)


# -- bare pyzmq ------------------------------------------------------------------------------------
def _bare_sender(conn: Connection, hwm: int, ipc_path: str | None = None, checksum: bool = False,
                 copy: bool = False) -> None:
    """Child process: bind PUSH (tcp loopback, or ``ipc://ipc_path``), report the endpoint, then
    per request send the array n times (with ``checksum``, each time as two frames: the xxh3-64 of
    its bytes, taken just before, then the array; with ``copy``, of a new copy of it each time).

    It leaves when asked (None), when the parent goes away (EOF), or after a long silence, so an
    orphan never lingers.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT_S * 1000))
    try:
        if ipc_path is None:
            endpoint = f"tcp://{HOST}:{sock.bind_to_random_port(f'tcp://{HOST}')}"
        else:
            endpoint = f"ipc://{ipc_path}"
            sock.bind(endpoint)
        arr = make_array()
        conn.send(endpoint)
        while conn.poll(10 * TIMEOUT_S):
            n = conn.recv()
            if n is None:
                break
            for _ in range(n):
                if checksum:
                    out = arr.copy() if copy else arr  # (C-contiguous: hashed as its bytes)
                    sock.send_multipart([xxhash.xxh3_64_intdigest(out).to_bytes(8, "little"), out], copy=False)
                else:
                    sock.send(arr, copy=False)
            conn.send(n)
    except (EOFError, BrokenPipeError, zmq.Again):
        pass
    finally:
        sock.close(linger=0)
        ctx.term()


class BareSender:
    """The bare pyzmq sender process (spawned, so it shares nothing with this one); on tcp
    loopback, or on ``ipc://ipc_path`` if given; ``checksum``: each array goes with its xxh3-64,
    checked on arrival; ``copy`` (with ``checksum``): a copy of the array made for each send."""

    def __init__(self, hwm: int = HWM, ipc_path: str | None = None, checksum: bool = False, copy: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.checksum = checksum
        self._proc = ctx.Process(target=_bare_sender, args=(child, hwm, ipc_path, checksum, copy),
                                 name="bare-pyzmq-sender", daemon=True)
        self.endpoint = ""
        self.exit_status: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def __enter__(self) -> "BareSender":
        self._proc.start()
        try:
            self.endpoint = self._await("endpoint")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(10)
        killed = self._proc.is_alive()
        if killed:
            self._proc.terminate()
            self._proc.join(10)
        self.exit_status = {"exit_code": self._proc.exitcode, "killed": killed, "clean": self._proc.exitcode == 0}

    def _await(self, what: str) -> Any:
        if not self._conn.poll(TIMEOUT_S):
            raise TimeoutError(f"bare pyzmq sender: no {what} within {TIMEOUT_S:.0f}s")
        return self._conn.recv()

    def receive(self, batches: int) -> Iterator[tuple[np.ndarray]]:
        """Connect a PULL socket, ask for ``batches`` arrays, and yield each as received."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
        try:
            sock.connect(self.endpoint)
            self._conn.send(batches)  # the readiness handshake: it sends only once asked
            for i in range(batches):
                if self.checksum:
                    digest, frame = sock.recv_multipart(copy=False)
                    if xxhash.xxh3_64_intdigest(frame.buffer) != int.from_bytes(digest.bytes, "little"):
                        raise RuntimeError(f"bare pyzmq + xxh3: batch {i} arrived with another checksum")
                else:
                    frame = sock.recv(copy=False)
                yield (np.frombuffer(frame, dtype=DTYPE).reshape(SHAPE),)
            if self._await("acknowledgement") != batches:
                raise RuntimeError("bare pyzmq sender acknowledged another count")
        finally:
            sock.close(linger=0)


def bare_round(sender: BareSender, batches: int, name: str = BARE) -> Round:
    threads = {"sender": sender.pid, "receiver": os.getpid()}
    return _checked(time_batches(sender.receive(batches), producer_pid=sender.pid, threads_of=threads,
                                 threads_of_children=False), batches, name)


# -- fuelline ------------------------------------------------------------------------------------
class RepeatedArrayStream:
    """The smallest Fuel-style stream: the same preallocated array, ``batches`` times an epoch.
    It never writes to the array, so it keeps the promise of ``fresh_arrays=True`` too."""

    sources = ("features",)

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.array = make_array()

    def get_epoch_iterator(self, **kwargs: Any) -> Iterator[tuple[np.ndarray]]:
        return ((self.array,) for _ in range(self.batches))


def serve_repeated_array(batches: int, checksum: bool, fresh_arrays: bool = False) -> None:
    """Entry point of the server process (it prints ``serving on ...`` and serves until SIGTERM)."""
    from fuelline.server import start_server

    start_server(RepeatedArrayStream(batches), port=0, hwm=HWM, host=HOST, checksum=checksum, fresh_arrays=fresh_arrays)


def fuelline_server(name: str, batches: int, checksum: bool, log_dir: Path, fresh_arrays: bool = False) -> ServerProcess:
    code = ("from benchmarks.transport import serve_repeated_array; "
            f"serve_repeated_array({batches!r}, {checksum!r}, {fresh_arrays!r})")
    return ServerProcess(name, [sys.executable, "-c", code], log_dir / f"{name.replace(' ', '_')}.log")


def fuelline_round(server: ServerProcess, batches: int, local: bool = False, name: str | None = None) -> Round:
    """One epoch through ``ServerDataStream``: over TCP, or (``local``) through the Unix socket the
    server offers to clients on its host, as a default client does."""
    with ServerDataStream(("features",), host=server.host, port=server.port, hwm=HWM, timeout=TIMEOUT_S,
                          receive_timeout=TIMEOUT_S, local=local) as stream:
        r = time_batches(stream.get_epoch_iterator(), producer_pid=server.pid,
                         threads_of={"server": server.pid, "client": os.getpid()}, threads_of_children=False)
        where = stream.transports[0]
    if where.startswith("ipc://") != local:
        raise RuntimeError(f"{name or server.name}: read through {where}, expected {'ipc' if local else 'tcp'}")
    return _checked(r, batches, name or server.name)


def _checked(r: Round, batches: int, who: str) -> Round:
    if r.batches != batches or r.rows != (batches - 1) * SHAPE[0]:
        raise RuntimeError(f"{who}: {r.batches} batches / {r.rows} timed rows arrived, expected {batches}")
    return r


# -- the benchmark ----------------------------------------------------------------------------------
def run(rounds: int, batches: int, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run the transport benchmark, print its table and write its results; returns the record."""
    from benchmarks import plots
    from fuelline.client import heap

    env = environment()
    batch_bytes = int(np.prod(SHAPE)) * np.dtype(DTYPE).itemsize
    # Every receiver runs in this process: its heap is set as a fuelline reader's own is, from the
    # start, so bare pyzmq's receivers, before and after the first fuelline round, run on the same.
    held = heap.hold("transport benchmark", HWM * batch_bytes)
    with tempfile.TemporaryDirectory(prefix="fuelline-bench-") as logs, ExitStack() as stack:
        bare = stack.enter_context(BareSender())
        bare_ipc = stack.enter_context(BareSender(ipc_path=str(Path(logs) / "bare.sock")))
        bare_xxh3 = stack.enter_context(BareSender(checksum=True))
        bare_copy_xxh3 = stack.enter_context(BareSender(checksum=True, copy=True))
        with_ck = stack.enter_context(fuelline_server(FUELLINE, batches, True, Path(logs)))
        no_ck = stack.enter_context(fuelline_server(NO_CHECKSUM, batches, False, Path(logs)))
        fresh = stack.enter_context(fuelline_server(FRESH, batches, True, Path(logs), fresh_arrays=True))
        fresh_no_ck = stack.enter_context(fuelline_server(FRESH_NO_CHECKSUM, batches, False, Path(logs), fresh_arrays=True))
        contenders = [
            Contender(BARE, lambda: bare_round(bare, batches)),
            Contender(BARE_IPC, lambda: bare_round(bare_ipc, batches, BARE_IPC)),
            Contender(BARE_XXH3, lambda: bare_round(bare_xxh3, batches, BARE_XXH3)),
            Contender(BARE_COPY_XXH3, lambda: bare_round(bare_copy_xxh3, batches, BARE_COPY_XXH3)),
            Contender(FUELLINE, lambda: fuelline_round(with_ck, batches)),
            Contender(NO_CHECKSUM, lambda: fuelline_round(no_ck, batches)),
            Contender(LOCAL, lambda: fuelline_round(with_ck, batches, local=True, name=LOCAL)),
            Contender(LOCAL_NO_CHECKSUM, lambda: fuelline_round(no_ck, batches, local=True, name=LOCAL_NO_CHECKSUM)),
            Contender(FRESH, lambda: fuelline_round(fresh, batches)),
            Contender(LOCAL_FRESH, lambda: fuelline_round(fresh, batches, local=True, name=LOCAL_FRESH)),
            Contender(FRESH_NO_CHECKSUM, lambda: fuelline_round(fresh_no_ck, batches)),
        ]
        ipc_note = ("fuelline, local: a default ServerDataStream on the server's host, which moves from TCP to the "
                    "Unix socket the server offers (the same server processes as the TCP contenders); held to bare "
                    "pyzmq on ipc.")
        gbps = Metric("GB/s", lambda r: r.bytes / r.seconds / 1e9, "{:.3f}")
        results = alternate(contenders, rounds, lambda r: f"{gbps.of(r):.3f} GB/s")
        stack.close()  # stop the servers now: their exit status belongs in the record
        exits = {BARE: bare.exit_status, BARE_IPC: bare_ipc.exit_status, BARE_XXH3: bare_xxh3.exit_status,
                 BARE_COPY_XXH3: bare_copy_xxh3.exit_status,
                 FUELLINE: with_ck.exit_status, NO_CHECKSUM: no_ck.exit_status, LOCAL: with_ck.exit_status, LOCAL_NO_CHECKSUM: no_ck.exit_status,
                 FRESH: fresh.exit_status, LOCAL_FRESH: fresh.exit_status, FRESH_NO_CHECKSUM: fresh_no_ck.exit_status}
    parameters = {
        "rounds": rounds, "batches_per_round": batches, "shape": list(SHAPE), "dtype": np.dtype(DTYPE).name,
        "batch_bytes": batch_bytes, "bytes_per_round": batch_bytes * batches, "hwm": HWM, "host": HOST,
        "order": "one untimed warm-up pass of each, then rounds of " + ", ".join(c.name for c in contenders),
    }
    notes = [
        f"{rounds} timed rounds of {batches} batches of {batch_bytes / 1e6:.3f} MB ({SHAPE[0]}×{SHAPE[1]} float32) each; "
        "contenders run alternately (" + " ".join(c.name for c in contenders) + " ...), each round after one "
        "untimed warm-up pass of every contender (no files are read, so there is no page cache to warm).",
        "A rate counts the batches after the first over the time from the first batch's arrival to the last's: "
        "connection setup and the first batch are excluded, alike for all contenders. GB = 10^9 bytes.",
        "Every sender is a separate process on the same loopback; bare pyzmq is PUSH/PULL, send(copy=False) of "
        "one preallocated array, recv(copy=False) + np.frombuffer, high-water mark 10, on tcp://127.0.0.1 and on "
        "an ipc:// socket in a temporary directory.",
        "bare pyzmq + xxh3: the same over tcp, the sender taking the xxh3-64 of the array before each send (an 8-byte "
        "frame ahead of it) and the receiver checking it against the received frame. It is what an end-to-end "
        "checksum costs with no protocol at all: bare pyzmq + xxh3 / bare pyzmq bounds what any transport with "
        "integrity checks on can reach on this machine, and fuelline / bare pyzmq + xxh3 is fuelline's own share. "
        "bare pyzmq + copy + xxh3: the sender also copies the array (np.copy, a new array each time) and sends "
        "the copy with its xxh3: what start_server's default does to every batch, with no protocol; fuelline / "
        "bare pyzmq + copy + xxh3 compares like with like.",
        ipc_note,
        "fuelline: start_server(stream, port=0, hwm=10) in a child process, ServerDataStream(hwm=10) reading one "
        "epoch per round (a new client each round); every array is touched (one element read).",
        "fuelline and fuelline, local (and their --no-checksum) are start_server's default: the server copies each "
        "batch once as it reads it from the stream, checksumming it in the same pass, so that a stream may refill "
        "one buffer for every batch. fuelline, fresh_arrays and fuelline, local, fresh_arrays serve the same "
        "stream with start_server(..., fresh_arrays=True): the stream's own array is sent, not copied (allowed "
        "only for a stream that never writes to an array it yielded, as this one).",
        "CPU s/GB adds the consumer's and the sender's CPU time (all threads, /proc) over the timed span; on a "
        "2-core machine it shows how much of the machine each contender needs.",
        f"{FRESH_NO_CHECKSUM}: the stream's array, neither copied nor checksummed, over TCP: what fuelline's "
        "protocol (headers, credit, sessions, its threads) costs beside bare pyzmq, with nothing else to do.",
        "CPU by thread: each end's threads, the sender or server (its main thread is a server's serving loop; "
        "producers: the thread that reads the stream, copies and hashes) and the receiver or client (main: the "
        "consumer's own thread; keep-alive: the client's keep-alive thread), libzmq's I/O threads on both; their "
        "kernel time (the socket copies) is in libzmq's. The receiver's process also holds the idle threads of "
        "the other contenders' clients.",
        (f"Every receiver runs in the benchmark's process, whose heap is set from the start as a fuelline reader sets "
         f"its own from its first batch (fuelline.client.heap: glibc's trim threshold {held} bytes, mmap threshold "
         "32 MB), so that bare pyzmq's receivers and fuelline's run on the same heap; `python -m benchmarks heap` "
         "measures what that changes, each reader in a process of its own."
         if held else f"Every receiver runs in the benchmark's process, on glibc's own heap thresholds ({heap.why_left_alone()})."),
    ]
    record, md = build_report(
        "transport", "transport — 3 MB batches over tcp loopback and ipc", results, [gbps],
        [RatioSpec(FUELLINE, BARE, 0.80), RatioSpec(NO_CHECKSUM, BARE, 0.80), RatioSpec(LOCAL, BARE_IPC, 0.80),
         RatioSpec(LOCAL_NO_CHECKSUM, BARE_IPC, 0.80), RatioSpec(FRESH, BARE, 0.80), RatioSpec(LOCAL_FRESH, BARE_IPC, 0.80),
         RatioSpec(FRESH_NO_CHECKSUM, BARE, 0.80),
         RatioSpec(LOCAL, BARE), RatioSpec(FUELLINE, NO_CHECKSUM), RatioSpec(FUELLINE, FRESH),
         RatioSpec(LOCAL, LOCAL_FRESH), RatioSpec(BARE_IPC, BARE),
         RatioSpec(BARE_XXH3, BARE), RatioSpec(FUELLINE, BARE_XXH3), RatioSpec(FRESH, BARE_XXH3),
         RatioSpec(BARE_COPY_XXH3, BARE), RatioSpec(FUELLINE, BARE_COPY_XXH3)],
        parameters, notes, env, exits=exits,
    )
    print(md, flush=True)
    for path in write_results("transport", record, md, results_dir):
        print(f"wrote {path}", flush=True)
    print(f"wrote {plots.for_record(record, results_dir)}", flush=True)
    return record
