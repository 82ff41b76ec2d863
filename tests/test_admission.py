"""Admission and bounds: a server stays up, and within its own caps, whatever peers send or claim.

DESIGN.md (Safety): sessions, threads and memory are bounded by the server's own caps, whatever
peers send or claim (credit, heartbeat, world size). Each test attacks a real server process over
loopback, checks the bound the attack used to break (threads, memory, time to stop, the process
itself), and that an honest client reading at the same time gets its exact epoch.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Batch, Bye, Credit, Error, Heartbeat, Hello, Welcome, decode, encode
from fuelline.server.sources.sample import write_sample_dataset

from support.processes import RssSampler, wait_until

REPLY_WAIT = 10.0  # seconds a peer waits for an answer from a busy server on 2 shared cores
ROWS = 8000  # train rows of the sample_dataset fixture: sample_id 0..7999
WIDE_ROWS = 6400  # train rows of the wide dataset: sample_id 0..6399
WIDE_BATCH = 640  # rows per batch: 10 batches of 655 KB (256 float32 features a row)


@pytest.fixture(scope="module")
def wide_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8000 rows of 256 features (6400 train): batches big enough that holding them shows."""
    out = tmp_path_factory.mktemp("wide") / "wide"
    write_sample_dataset(str(out), rows=8000, dim=256, files=4, row_group_rows=800)
    return out


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class ThreadPeak(threading.Thread):
    """The most threads a process had, sampled every 20 ms (a burst between two checks shows too)."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="thread-peak", daemon=True)
        self.pid = pid
        self.baseline = self.peak = thread_count(pid)
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            try:
                self.peak = max(self.peak, thread_count(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        self._stop_event.set()
        self.join(5.0)
        return self.peak


class Peer:
    """A raw DEALER speaking the protocol by hand; ``source`` binds its end to another loopback
    address (127.0.0.2...), so the server sees another peer."""

    def __init__(self, ctx: zmq.Context, port: int, source: str | None = None, rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(f"tcp://{source}:0;127.0.0.1:{port}" if source else f"tcp://127.0.0.1:{port}")

    def send(self, msg: Any) -> None:
        self.sock.send_multipart(encode(msg) if not isinstance(msg, list) else msg, copy=False)

    def recv(self, timeout: float = REPLY_WAIT) -> Any:
        """The next message, decoded; None if nothing came within ``timeout``."""
        if not self.sock.poll(timeout * 1000):
            return None
        return decode(self.sock.recv_multipart(copy=False))

    def answer(self, timeout: float = REPLY_WAIT) -> Any:
        """The next message that is not a Heartbeat."""
        deadline = time.monotonic() + timeout
        while (msg := self.recv(max(0.0, deadline - time.monotonic()))) is not None and isinstance(msg, Heartbeat):
            pass
        return msg

    def close(self) -> None:
        self.sock.close(linger=0)


class HonestReader(threading.Thread):
    """Reads one epoch of ``sample_id`` in the background, parking after batch ``park_at`` until
    the attack is over (so the attack meets a session with batches in flight). It records its
    MB/s and the longest gap between two batches; timeouts make a hung server fail the test."""

    def __init__(self, port: int, attack_over: threading.Event, park_at: int = 3, hwm: int = 4) -> None:
        super().__init__(name="honest-reader", daemon=True)
        self.port, self.attack_over, self.park_at, self.hwm = port, attack_over, park_at, hwm
        self.streaming = threading.Event()
        self.ids: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.max_gap = 0.0

    def run(self) -> None:
        try:
            with ServerDataStream(("sample_id",), host="127.0.0.1", port=self.port, hwm=self.hwm, timeout=20.0,
                                  receive_timeout=20.0) as stream:
                last = None
                for (ids,) in stream.get_epoch_iterator():
                    now = time.monotonic()
                    if last is not None and len(self.ids) != self.park_at:
                        self.max_gap = max(self.max_gap, now - last)
                    self.ids.append(ids)
                    self.streaming.set()
                    if len(self.ids) == self.park_at:
                        self.attack_over.wait(60.0)  # the keep-alive thread heartbeats meanwhile
                    last = time.monotonic()
        except BaseException as exc:  # handed to the test's thread, which asserts on it
            self.error = exc
        finally:
            self.streaming.set()

    def check_epoch(self, rows: int) -> None:
        self.join(30.0)
        assert not self.is_alive(), "the honest client did not finish its epoch within 30s of the attack"
        assert self.error is None, f"the honest client failed: {self.error!r}"
        ids = np.sort(np.concatenate(self.ids))
        assert np.array_equal(ids, np.arange(rows)), f"the honest client got {len(ids)} rows, {len(np.unique(ids))} distinct"


def start_honest(port: int, park_at: int = 3, hwm: int = 4) -> tuple[HonestReader, threading.Event]:
    attack_over = threading.Event()
    honest = HonestReader(port, attack_over, park_at, hwm)
    honest.start()
    assert honest.streaming.wait(20.0) and honest.error is None, f"no first batch: {honest.error!r}"
    return honest, attack_over


def welcome_all(peers: list[Peer], hello: Any) -> list[Any]:
    for i, peer in enumerate(peers):
        peer.send(hello(i))
    return [peer.answer() for peer in peers]


# -- attack 1: connections that say Hello and nothing more ------------------------------------------
@pytest.mark.timeout(60)
def test_idle_hellos_cost_no_thread_and_little_memory(wide_dataset: Path, start_serve, zmq_context) -> None:
    server = start_serve(wide_dataset, "--batch-size", str(WIDE_BATCH), "--hwm", "4")
    honest, attack_over = start_honest(server.port)
    rss, threads = RssSampler(server.proc.pid), ThreadPeak(server.proc.pid)
    peers = [Peer(zmq_context, server.port) for _ in range(200)]
    try:
        answers = welcome_all(peers, lambda i: Hello(f"idle-{i}", credit=0, heartbeat=3600.0))
        assert all(isinstance(a, Welcome) for a in answers), [a for a in answers if not isinstance(a, Welcome)][:3]
        threads_welcomed = thread_count(server.proc.pid)  # (each producer used to start as its Welcome left)
    finally:
        attack_over.set()
    try:
        honest.check_epoch(WIDE_ROWS)  # the idle sessions still open meanwhile
    finally:
        rss_peak, threads_peak = rss.stop(), max(threads.stop(), threads_welcomed)
        for peer in peers:
            peer.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    print(f"\nidle hellos: server threads {threads.baseline} -> {threads_peak}, RSS {rss.baseline:.0f} -> "
          f"{rss_peak:.0f} MB; honest longest gap {honest.max_gap * 1e3:.0f} ms")
    # A session with no credit has no producer thread and holds no batch: 200 of them may cost
    # their Python objects and libzmq's pipes (a few MB), not 200 threads × 2 × hwm batches
    # (~1 GB here). The read-ahead pool may start its threads meanwhile (up to min(4, cores)).
    assert threads_peak <= threads.baseline + min(4, os.cpu_count() or 1), f"{threads_peak} threads"
    assert rss_peak - rss.baseline < 64, f"server RSS grew {rss_peak - rss.baseline:.0f} MB for 200 idle sessions"


@pytest.mark.timeout(60)
def test_idle_connections_over_the_caps_never_lock_an_honest_client_out(sample_dataset: Path, start_serve,
                                                                        zmq_context) -> None:
    # More idle connections than the server has places, all of them young: the honest client,
    # whose Hello grants credit, takes an idle one's place at once.
    server = start_serve(sample_dataset, "--batch-size", "1000", "--max-clients", "8")
    peers = [Peer(zmq_context, server.port) for _ in range(20)]
    try:
        for i, peer in enumerate(peers):
            peer.send(Hello(f"idle-{i}", credit=0, heartbeat=3600.0))
        answers = [peer.answer() for peer in peers]
        assert any(isinstance(a, Error) and a.code == "busy" for a in answers), answers  # the caps are reached
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=10.0, local=False) as stream:
            ids = [int(i) for (batch,) in stream.get_epoch_iterator() for i in batch]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 8000
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.timeout(30)
def test_a_silent_client_is_dropped_within_the_servers_heartbeat_bound(sample_dataset: Path, start_serve,
                                                                     zmq_context) -> None:
    server = start_serve(sample_dataset, "--heartbeat", "0.1", "--max-client-heartbeat", "0.5")
    peer = Peer(zmq_context, server.port)
    try:
        peer.send(Hello("mute", credit=0, heartbeat=3600.0))  # "drop me after three hours of silence"
        assert isinstance(peer.answer(), Welcome)
        # Cut to 0.5 s: dropped after 3 × 0.5 s of silence, not 3 hours.
        text = server.wait_log(r"client mute#\w+ dropped: silent for [\d.]+s", timeout=10.0)
    finally:
        peer.close()
    silent = float(text.split("dropped: silent for ")[1].split("s")[0])
    assert 1.5 <= silent < 5.0, f"dropped after {silent}s of silence"


# -- the caps ----------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_hello_over_a_cap_is_refused_busy_naming_the_cap(sample_dataset: Path, start_serve, zmq_context) -> None:
    server = start_serve(sample_dataset, "--max-clients", "4", "--max-clients-per-peer", "2", "--hwm", "2")
    working = [Peer(zmq_context, server.port, source=source) for source in ("127.0.0.2", "127.0.0.2",
                                                                                "127.0.0.3", "127.0.0.3")]
    extra = {source: Peer(zmq_context, server.port, source=source) for source in ("127.0.0.2", "127.0.0.4")}
    try:
        # Four reading clients (each granted credit), two per address: the server is full.
        answers = welcome_all(working, lambda i: Hello(f"worker-{i}", credit=2, heartbeat=10.0))
        assert all(isinstance(a, Welcome) for a in answers), answers
        extra["127.0.0.2"].send(Hello("third-from-2", credit=2, heartbeat=10.0))
        refused = extra["127.0.0.2"].answer()
        assert isinstance(refused, Error) and refused.code == "busy" and refused.fatal, refused
        assert "2 sessions from 127.0.0.2" in refused.message and "--max-clients-per-peer" in refused.message
        extra["127.0.0.4"].send(Hello("fifth", credit=2, heartbeat=10.0))
        refused = extra["127.0.0.4"].answer()
        assert isinstance(refused, Error) and refused.code == "busy", refused
        assert "4 sessions (--max-clients)" in refused.message, refused.message
        # Refused, not served: no batch follows; and the working sessions were kept.
        assert extra["127.0.0.4"].answer(0.5) is None
        for peer in working:
            assert isinstance(peer.answer(), Batch)
        # A session that ends makes room again.
        working[0].send(Bye("done"))
        server.wait_log(r"client worker-0#\w+ dropped: said bye")
        extra["127.0.0.4"].send(Hello("fifth", credit=2, heartbeat=10.0))
        assert isinstance(extra["127.0.0.4"].answer(), Welcome)
    finally:
        for peer in [*working, *extra.values()]:
            peer.close()
    assert "refused: server busy" in server.log()


@pytest.mark.timeout(60)
def test_idle_sessions_make_room_for_a_newcomer_and_working_ones_do_not(sample_dataset: Path, start_serve,
                                                                       zmq_context) -> None:
    grace = 1.0
    server = start_serve(sample_dataset, "--max-clients", "3", "--max-client-heartbeat", str(grace),
                         "--heartbeat", "0.1", "--hwm", "2")
    working = Peer(zmq_context, server.port)
    idle = [Peer(zmq_context, server.port) for _ in range(2)]
    honest = Peer(zmq_context, server.port)
    attempts: list[Any] = []
    try:
        working.send(Hello("working", credit=1, heartbeat=grace))
        assert isinstance(working.answer(), Welcome) and isinstance(working.answer(), Batch)
        answers = welcome_all(idle, lambda i: Hello(f"idle-{i}", credit=0, heartbeat=grace))
        assert all(isinstance(a, Welcome) for a in answers), answers
        # A newcomer that grants credit takes the oldest idle session's place at once: idle
        # connections, however many and however young, never lock an honest client out.
        honest.send(Hello("honest", credit=2, heartbeat=grace))
        assert isinstance(honest.answer(), Welcome) and isinstance(honest.answer(), Batch)
        gone = idle[0].answer(REPLY_WAIT)
        assert isinstance(gone, Bye) and "granted no credit" in gone.reason, gone
        idle[0].close()
        # The server is full again: one working, one idle, one honest. Another idle newcomer is
        # refused while the idle session is young, and takes its place once it has gone a grace
        # period without granting credit.
        full_at = time.monotonic()
        welcomed_at = None
        while welcomed_at is None and time.monotonic() - full_at < 10.0:
            for peer in [working, honest, idle[1]]:
                peer.send(Heartbeat())  # all alive: only credit (or its absence) tells them apart
            newcomer = Peer(zmq_context, server.port)
            newcomer.send(Hello("newcomer", credit=0, heartbeat=grace))
            attempts.append(newcomer.answer())
            newcomer.close()
            if isinstance(attempts[-1], Welcome):
                welcomed_at = time.monotonic()
            else:
                time.sleep(0.05)  # pacing the retries (the deadline above bounds the wait)
        assert isinstance(attempts[0], Error) and attempts[0].code == "busy", attempts[0]
        assert welcomed_at is not None and welcomed_at - full_at >= grace / 2, attempts[-3:]
        gone = idle[1].answer(REPLY_WAIT)
        assert isinstance(gone, Bye) and "granted no credit" in gone.reason, gone
        # That newcomer is idle in turn, and gives way to one that grants credit; once every
        # session works, a newcomer is refused: working sessions are never the ones given up.
        late = Peer(zmq_context, server.port)
        late.send(Hello("late", credit=2, heartbeat=grace))
        assert isinstance(late.answer(), Welcome)
        later = Peer(zmq_context, server.port)
        later.send(Hello("later", credit=2, heartbeat=grace))
        refused = later.answer()
        later.close()
        late.close()
        assert isinstance(refused, Error) and refused.code == "busy", refused
        working.send(Credit(1))
        assert isinstance(working.answer(), Batch)
    finally:
        for peer in [working, honest, *idle]:
            peer.close()
    given_up = [line.split(" dropped")[0].rsplit(" ", 1)[-1] for line in server.log().splitlines()
                if "granted no credit" in line]
    assert [g.split("#")[0] for g in given_up] == ["idle-0", "idle-1", "newcomer"], given_up


# -- attack 2: credit lies ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("lie, pace, dropped_for", [
    # Credit(2**30) again and again: refused at once.
    (2**30, 0.005, "a credit no client could grant, from 127.0.0.1"),
    # Credit(1) per batch it was sent, reading none: each lie is one an honest client could tell,
    # so the send queue's cap (hwm batches and a few control messages) is what stops it; where the
    # server's producer falls behind the lies, the credit check does.
    (1, 0.02, "(not reading|a credit no client could grant)"),
])
def test_a_client_that_grants_credit_and_reads_nothing_is_dropped_and_costs_at_most_its_hwm(
    wide_dataset: Path, start_serve, zmq_context, lie: int, pace: float, dropped_for: str
) -> None:
    hwm, memory_cache, control_messages = 4, 10, 16
    server = start_serve(wide_dataset, "--batch-size", str(WIDE_BATCH), "--hwm", str(hwm),
                         "--memory-cache", str(memory_cache))
    honest, attack_over = start_honest(server.port)
    rss = RssSampler(server.proc.pid)
    liar = Peer(zmq_context, server.port, rcvhwm=1)  # reads (almost) nothing: what is sent piles up
    dropped = re.compile(rf"client liar#\w+ dropped: {dropped_for}")
    try:
        # Credit for batches a session never sent is no lie from a client that reconnected
        # holding batches of its connection before: it returns their credit as its user takes them.
        before, after = Peer(zmq_context, server.port), Peer(zmq_context, server.port)
        before.send(Hello("reconnecting", credit=hwm, heartbeat=60.0))
        assert isinstance(before.answer(), Welcome)
        assert [getattr(before.answer(), "seq", None) for _ in range(hwm)] == list(range(hwm))
        before.close()
        after.send(Hello("reconnecting", cursor=hwm, credit=0, heartbeat=60.0))  # holding hwm batches
        assert isinstance(after.answer(), Welcome)
        for _ in range(hwm):
            after.send(Credit(1))
        assert [getattr(after.answer(), "seq", None) for _ in range(hwm)] == list(range(hwm, 2 * hwm))
        after.close()

        liar.send(Hello("liar", credit=hwm, heartbeat=3600.0))
        assert isinstance(liar.answer(), Welcome)
        assert isinstance(liar.answer(), Batch)  # its hwm batches are on their way
        deadline = time.monotonic() + 20.0
        while not dropped.search(server.log()) and time.monotonic() < deadline:
            for _ in range(10):
                liar.send(Credit(lie))
                time.sleep(pace)  # pacing the attack, so each lie meets the batches the last one let through
        text = server.wait_log(dropped.pattern, timeout=1.0)
    finally:
        attack_over.set()
        try:
            honest.check_epoch(WIDE_ROWS)
        finally:
            rss_peak = rss.stop()
            liar.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    print(f"\ncredit lies of {lie}: {dropped.search(text).group(0)!r}; server RSS {rss.baseline:.0f} -> "
          f"{rss_peak:.0f} MB; honest longest gap {honest.max_gap * 1e3:.0f} ms")
    # What the liar may cost: its memory tier (memory_cache + hwm batches), the hwm prepared
    # ahead, and its send queue (hwm batches and the control messages); plus allocator slack (the
    # producer threads' malloc arenas keep freed batches). libzmq's default queue of 1000
    # messages per peer held over 600 MB here.
    batch_mb = WIDE_BATCH * 256 * 4 / 2**20
    bound = (memory_cache + 3 * hwm + control_messages) * batch_mb + 96
    assert rss_peak - rss.baseline < bound, f"server RSS grew {rss_peak - rss.baseline:.0f} MB (bound {bound:.0f})"
    assert "Traceback" not in text


# -- attack 3: big messages of a kind that carries no arrays ----------------------------------------
@pytest.mark.timeout(90)
def test_messages_of_many_frames_are_refused_by_their_header_without_copying_them(
    sample_dataset: Path, start_serve, zmq_context
) -> None:
    server = start_serve(sample_dataset, "--batch-size", "64", "--hwm", "4")
    honest, attack_over = start_honest(server.port)
    rss = RssSampler(server.proc.pid)
    frames_per_message, messages = 100, 16
    frame = bytes((1 << 20) - 64)  # each frame under the server's 1 MiB limit, 100 MiB a message
    attacker = Peer(zmq_context, server.port)
    attacker.sock.setsockopt(zmq.SNDHWM, 0)
    answers = []
    try:
        for i in range(messages):
            header = encode(Credit(1) if i % 2 else Hello("frames", credit=1))[0]
            attacker.send([header, *([frame] * frames_per_message)])
        answers = [attacker.answer() for _ in range(messages)]
        # A batch header that lists arrays the size of its frames is a batch, which only a
        # server may send: refused as such, its frames still unread.
        entries = [[f"a{i}", "|u1", [len(frame)], len(frame), None] for i in range(frames_per_message)]
        batch = msgpack.packb({"v": 1, "t": "batch", "stream": 0, "epoch": 0, "seq": 0, "a": entries, "ck": None})
        attacker.send([batch, *([frame] * frames_per_message)])
        answers.append(attacker.answer())
    finally:
        attack_over.set()
        try:
            honest.check_epoch(ROWS)
        finally:
            rss_peak = rss.stop()
            attacker.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    codes = [a.code if isinstance(a, Error) else a for a in answers]
    assert codes == ["malformed"] * messages + ["bad-request"], codes
    assert "carries 100 unexpected frames" in answers[0].message, answers[0].message
    print(f"\n{messages} messages of {frames_per_message} MiB: server RSS {rss.baseline:.0f} -> {rss_peak:.0f} MB; "
          f"honest longest gap {honest.max_gap * 1e3:.0f} ms")
    # libzmq assembles a whole multipart message before the server sees its first frame (it caps
    # frames, not messages): one or two such messages in flight are unavoidable. A copy of each
    # into Python, as received before, doubles that and lets a backlog build.
    message_mb = frames_per_message * len(frame) / 2**20
    assert rss_peak - rss.baseline < 2 * message_mb + 32, f"server RSS grew {rss_peak - rss.baseline:.0f} MB"


# Sources for start_script servers: ``COUNTING`` yields ``BATCHES`` batches of 64 sample ids per
# epoch; ``split`` "broken" has a bug; ``stall`` makes every batch after the first a read that
# stalls for a minute (storage that hangs).
SOURCE = """
import threading, time
import numpy as np
from fuelline.server.sources.contract import BatchSource

BATCHES = 20

class Counting(BatchSource):
    sources = ("sample_id",)
    splits = ("train", "broken")

    def __init__(self, stall=False):
        super().__init__()
        self.stall = stall

    def schema(self):
        return {"sample_id": {"dtype": "<i8", "shape": []}}

    def info(self, split):
        if split == "broken":
            raise ZeroDivisionError("a bug in the source")
        return {"rows": BATCHES * 64}

    def fingerprint(self, split):
        return {"batches": str(BATCHES)}

    def batches_per_epoch(self, split, rank, world_size):
        return BATCHES

    def iter_batches(self, split, epoch, rank, world_size, start, sources, on_loss=None, history=()):
        for i in range(start, BATCHES):
            if self.stall and i > start:
                threading.Event().wait(60.0)
            yield {"sample_id": np.arange(i * 64, (i + 1) * 64, dtype=np.int64)}

    def close(self):
        pass
"""


@pytest.mark.timeout(60)
def test_sigterm_stops_a_server_with_50_sessions_within_5_seconds(start_script, zmq_context) -> None:
    server = start_script(SOURCE + """
from fuelline.server import start_server
start_server(Counting(stall=True), port=0, hwm=2)
""")
    base = thread_count(server.proc.pid)
    peers = [Peer(zmq_context, server.port) for _ in range(50)]
    try:
        answers = welcome_all(peers, lambda i: Hello(f"reader-{i}", credit=2, heartbeat=60.0))
        assert all(isinstance(a, Welcome) for a in answers), answers[:3]
        for peer in peers:  # each read its first batch; its producer now waits on a stalled read
            assert isinstance(peer.answer(), Batch)
        wait_until(lambda: thread_count(server.proc.pid) >= base + 50, 10.0, "50 producer threads")
        start = time.monotonic()
        code = server.terminate(timeout=5.0)  # fails the test if the server is still up after 5 s
        took = time.monotonic() - start
        byes = sum(isinstance(peer.answer(1.0), Bye) for peer in peers)
    finally:
        for peer in peers:
            peer.close()
    print(f"\nSIGTERM with 50 sessions: exit {code} after {took:.2f}s")
    assert code == 0, server.log()[-3000:]
    assert byes == 50, f"{byes} of 50 clients were told the server is going"


@pytest.mark.timeout(90)
def test_a_request_that_fails_is_answered_and_the_server_keeps_serving(start_script, zmq_context) -> None:
    # Python threads reserve 512 MiB of address space each here, and the process may map only
    # 4 of them more: the 5th session's producer cannot start ("can't start new thread").
    server = start_script(SOURCE + """
import resource
from fuelline.server.serving.server import Server
from fuelline.server.serving.start import serve_until_signalled

threading.stack_size(512 << 20)
server = Server(Counting(), port=0, hwm=2, heartbeat=0.2, local_ipc=False)
server.bind()
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (4 * 512 + 256) * 2**20, resource.RLIM_INFINITY))
serve_until_signalled(server)
""")
    honest, attack_over = start_honest(server.port, park_at=5, hwm=2)
    peers: list[Peer] = []
    try:
        # A bug in the source, met while answering one Hello.
        broken = Peer(zmq_context, server.port)
        peers.append(broken)
        broken.send(Hello("broken", split="broken", credit=1, heartbeat=5.0))
        answer = broken.answer()
        assert isinstance(answer, Error) and answer.code == "internal", answer
        assert "ZeroDivisionError: a bug in the source" in answer.message, answer.message
        # More sessions than the process has threads for: the ones beyond are refused as busy.
        readers = [Peer(zmq_context, server.port) for _ in range(12)]
        peers += readers
        answers = welcome_all(readers, lambda i: Hello(f"reader-{i}", credit=1, heartbeat=5.0))
        busy = [a for a in answers if isinstance(a, Error)]
        assert busy and all(a.code == "busy" and "cannot start another thread" in a.message for a in busy), answers
        assert len(busy) < len(answers), "no session could start at all"
    finally:
        attack_over.set()
        try:
            honest.check_epoch(20 * 64)
        finally:
            for peer in peers:
                peer.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    # Their threads gone with their sessions (dropped as disconnected), a newcomer is served.
    deadline = time.monotonic() + 15.0
    while True:
        newcomer = Peer(zmq_context, server.port)
        try:
            newcomer.send(Hello("newcomer", credit=1, heartbeat=5.0))
            answer = newcomer.answer()
            if isinstance(answer, Welcome):
                assert isinstance(newcomer.answer(), Batch)
                break
        finally:
            newcomer.close()
        assert time.monotonic() < deadline, f"no newcomer served within 15s: {answer!r}"
    log = server.log()
    assert "ZeroDivisionError" in log and "from 127.0.0.1: handling a request failed" in log, log[-3000:]
