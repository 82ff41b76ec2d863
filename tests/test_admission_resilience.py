"""A server under load stops on SIGTERM in time, telling every session, and a request that fails
(a bug in the source, a thread that cannot start) is answered while the server keeps serving.

DESIGN.md (Safety): sessions, threads and memory are bounded by the server's own caps, whatever
peers send or claim (credit, heartbeat, world size). Each test attacks a real server process over
loopback, checks the bound the attack used to break, and that an honest client reading at the
same time gets its exact epoch.
"""

from __future__ import annotations

import time

import pytest

from fuelline.protocol import Batch, Bye, Error, Hello, Welcome

from support.admission import Peer, start_honest, thread_count, welcome_all
from support.processes import wait_until

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
