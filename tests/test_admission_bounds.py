"""Admission bounds under attack: idle Hellos, credit lies and big messages cost the server no
thread, and no memory, beyond its own caps.

DESIGN.md (Safety): sessions, threads and memory are bounded by the server's own caps, whatever
peers send or claim (credit, heartbeat, world size). Each test attacks a real server process over
loopback, checks the bound the attack used to break, and that an honest client reading at the
same time gets its exact epoch.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from fuelline.protocol import Batch, Credit, Error, Hello, Welcome, encode
from fuelline.server.sources.sample import write_sample_dataset

from support.admission import ROWS, WIDE_BATCH, WIDE_ROWS, Peer, ThreadPeak, start_honest, thread_count, welcome_all
from support.processes import RssSampler


@pytest.fixture(scope="module")
def wide_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8000 rows of 256 features (6400 train): batches big enough that holding them shows."""
    out = tmp_path_factory.mktemp("wide") / "wide"
    write_sample_dataset(str(out), rows=8000, dim=256, files=4, row_group_rows=800)
    return out


# -- attack 1: connections that say Hello and nothing more ------------------------------------------
@pytest.mark.timeout(60)
def test_idle_hellos_cost_no_thread_and_little_memory(wide_dataset: Path, start_serve, zmq_context) -> None:
    server = start_serve(wide_dataset, "--batch-size", str(WIDE_BATCH), "--hwm", "4")
    honest, attack_over = start_honest(server.port)
    rss, threads = RssSampler(server.proc.pid), ThreadPeak(server.proc.pid)
    # From two addresses: one may hold fewer than half of the server's 256 places.
    peers = [Peer(zmq_context, server.port, source=f"127.0.0.{2 + i % 2}") for i in range(200)]
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


# What one peer that reads nothing may cost the servers below (--hwm 4, --memory-cache 10): its
# memory tier (memory cache + hwm batches), the hwm prepared ahead, and its send queue (hwm
# batches and 16 control messages); plus allocator slack (freed batches kept by malloc's arenas).
# libzmq's default queue of 1000 messages per peer held over 600 MB here.
HWM, MEMORY_CACHE, CONTROL_MESSAGES = 4, 10, 16


@contextmanager
def _attacked(wide_dataset: Path, start_serve, peer_of) -> Iterator[tuple[Any, Any, RssSampler]]:
    """A server of the wide dataset (``HWM``, ``MEMORY_CACHE``), an honest client reading it
    meanwhile, and the attacking peer ``peer_of(port)``: yields (server, peer, RSS sampler).
    After the attack the honest client must get its exact epoch, the server must be up, and its
    memory within what one peer may cost."""
    server = start_serve(wide_dataset, "--batch-size", str(WIDE_BATCH), "--hwm", str(HWM),
                         "--memory-cache", str(MEMORY_CACHE))
    honest, attack_over = start_honest(server.port)
    rss = RssSampler(server.proc.pid)
    peer = peer_of(server.port)
    try:
        yield server, peer, rss
    finally:
        attack_over.set()
        try:
            honest.check_epoch(WIDE_ROWS)
        finally:
            rss.stop()
            peer.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    print(f"; server RSS {rss.baseline:.0f} -> {rss.peak:.0f} MB; honest longest gap {honest.max_gap * 1e3:.0f} ms")
    batch_mb = WIDE_BATCH * 256 * 4 / 2**20
    bound = (MEMORY_CACHE + 3 * HWM + CONTROL_MESSAGES) * batch_mb + 96
    assert rss.peak - rss.baseline < bound, f"server RSS grew {rss.peak - rss.baseline:.0f} MB (bound {bound:.0f})"


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
    dropped = re.compile(rf"client liar#\w+ dropped: {dropped_for}")
    # The liar reads (almost) nothing: what is sent piles up.
    with _attacked(wide_dataset, start_serve, lambda port: Peer(zmq_context, port, rcvhwm=1)) as (server, liar, _):
        # Credit for batches a session never sent is no lie from a client that reconnected
        # holding batches of its connection before: it returns their credit as its user takes them.
        before, after = Peer(zmq_context, server.port), Peer(zmq_context, server.port)
        before.send(Hello("reconnecting", credit=HWM, heartbeat=60.0))
        assert isinstance(before.answer(), Welcome)
        assert [getattr(before.answer(), "seq", None) for _ in range(HWM)] == list(range(HWM))
        before.close()
        after.send(Hello("reconnecting", cursor=HWM, credit=0, heartbeat=60.0))  # holding hwm batches
        assert isinstance(after.answer(), Welcome)
        for _ in range(HWM):
            after.send(Credit(1))
        assert [getattr(after.answer(), "seq", None) for _ in range(HWM)] == list(range(HWM, 2 * HWM))
        after.close()

        liar.send(Hello("liar", credit=HWM, heartbeat=3600.0))
        assert isinstance(liar.answer(), Welcome)
        assert isinstance(liar.answer(), Batch)  # its hwm batches are on their way
        deadline = time.monotonic() + 20.0
        while not dropped.search(server.log()) and time.monotonic() < deadline:
            for _ in range(10):
                liar.send(Credit(lie))
                time.sleep(pace)  # pacing the attack, so each lie meets the batches the last one let through
        text = server.wait_log(dropped.pattern, timeout=1.0)
        print(f"\ncredit lies of {lie}: {dropped.search(text).group(0)!r}", end="")
    assert "Traceback" not in text


@pytest.mark.timeout(60)
def test_a_client_that_says_hello_again_and_again_and_reads_nothing_is_dropped_as_not_reading(
    wide_dataset: Path, start_serve, zmq_context
) -> None:
    # Each Hello replaces the session before, whose batches may still be on their way: the new
    # one's wait for room in the peer's queue (an honest client that starts again is not dropped
    # for that), and so do their Welcomes. A peer whose queue stays full, or that piles up
    # Welcomes it never reads, is dropped.
    dropped = re.compile(r"client again#\w+ dropped: not reading")
    hellos = 0
    with _attacked(wide_dataset, start_serve, lambda port: Peer(zmq_context, port, rcvhwm=1)) as (server, peer, _):
        deadline = time.monotonic() + 20.0
        while not dropped.search(server.log()) and time.monotonic() < deadline:
            peer.send(Hello("again", stream=hellos, epoch=hellos % 3, credit=HWM, heartbeat=3600.0))
            hellos += 1
            time.sleep(0.02)  # pacing the attack, so that each Hello meets the last one's batches
        text = server.wait_log(dropped.pattern, timeout=1.0)
        print(f"\n{hellos} Hellos: {dropped.search(text).group(0)!r}", end="")
    assert "Traceback" not in text


FULL_QUEUE_SERVER = """
import zmq
from fuelline.server.serving.server import Server
from fuelline.server.serving.start import serve_until_signalled
from fuelline.server.sources.parquet import ParquetSource

server = Server(ParquetSource({path!r}, batch_size=640), port=0, hwm=2, heartbeat={heartbeat}, local_ipc=False)
server.bind()
# Small socket buffers: what is sent and not read fills libzmq's queue at once, not megabytes
# of the kernel's buffers first.
server._router.setsockopt(zmq.SNDBUF, 65536)
serve_until_signalled(server)
"""


def _hello_until_dropped(server, zmq_context, client: str, pattern: str, burst: int, pace: float) -> tuple[int, str]:
    """Send Hellos from one connection that reads (almost) nothing, each replacing the session
    before, ``burst`` at a time every ``pace`` seconds, until the server's log says ``pattern``
    (within 20 s). Returns the Hellos sent and the log."""
    peer = Peer(zmq_context, server.port, rcvhwm=1)
    peer.sock.setsockopt(zmq.RCVBUF, 65536)
    dropped = re.compile(pattern)
    hellos = 0
    try:
        deadline = time.monotonic() + 20.0
        while not dropped.search(server.log()) and time.monotonic() < deadline:
            for _ in range(burst):
                peer.send(Hello(client, stream=hellos, credit=2, heartbeat=3600.0))
                hellos += 1
            if pace:
                time.sleep(pace)  # pacing the attack
        text = server.wait_log(pattern, timeout=1.0)
    finally:
        peer.close()
    assert server.proc.poll() is None, server.log()[-3000:]
    assert "Traceback" not in text
    return hellos, text


@pytest.mark.timeout(60)
def test_a_peer_whose_send_queue_stays_full_is_dropped_as_not_reading(wide_dataset: Path, start_script,
                                                                       zmq_context) -> None:
    # Each Hello's Welcome and 2 batches of 655 kB fill a queue of 2 batches and 16 control
    # messages within a few; paced, so that it is the queue full for 3 heartbeats (0.6 s) that
    # ends it, not a pile of Welcomes behind it.
    server = start_script(FULL_QUEUE_SERVER.format(path=str(wide_dataset), heartbeat=0.2))
    _, text = _hello_until_dropped(server, zmq_context, "full", r"client full#\w+ dropped: not reading", 1, 0.1)
    match = re.search(r"client full#\w+ dropped: not reading[^\n]*", text)
    assert match is not None and "its send queue full for" in match.group(0), match


@pytest.mark.timeout(60)
def test_a_peer_that_piles_up_welcomes_behind_a_full_queue_is_dropped_as_not_reading(
    wide_dataset: Path, start_script, zmq_context
) -> None:
    # Heartbeats of 10 s: the queue would have to stay full for 30 s; the Welcomes of bursts of
    # Hellos, a megabyte of them, end it first.
    server = start_script(FULL_QUEUE_SERVER.format(path=str(wide_dataset), heartbeat=10.0))
    pattern = r"client piles#\w+ dropped: not reading: (\d+) Welcomes \((\d+) bytes\) waiting"
    hellos, text = _hello_until_dropped(server, zmq_context, "piles", pattern, 500, 0.0)
    match = re.search(pattern, text)
    assert match is not None
    print(f"\n{hellos} Hellos sent; {match.group(0)!r}")
    assert int(match.group(2)) > 2**20 and int(match.group(1)) < hellos


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
