"""Sessions stalled by their clients give their places on a full server; sessions waiting on the
server keep theirs.

DESIGN.md (Safety): sessions are bounded by the server's own caps, whatever peers send or claim.
A client that granted credit once and then reads nothing holds its place only until it has granted
none for ``--max-client-heartbeat`` seconds with none left: then a newcomer takes it, the longest
stalled first, and it is told so with a Bye. A session with credit left whose next batch is slow
to prepare waits on the server, and keeps its place however long that takes. Each test runs a
real server process and raw clients over loopback (127.0.0.2... are other addresses).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import Batch, Bye, Credit, Error, Heartbeat, Hello, Welcome

from support.admission import REPLY_WAIT, Peer, hello_until_welcomed

GRACE = 2.0  # --max-client-heartbeat: how long a session with no credit left may go without a grant


def _told_bye(peer: Peer, timeout: float = REPLY_WAIT) -> Bye | None:
    """The Bye a peer was sent, behind the batches it left unread; None if none came in ``timeout``."""
    deadline = time.monotonic() + timeout
    while (msg := peer.answer(max(0.0, deadline - time.monotonic()))) is not None and not isinstance(msg, Bye):
        pass
    return msg


def _given_up(log: str) -> list[str]:
    """The clients whose places went to newcomers, in order."""
    return re.findall(r"client ([\w.-]+)#\w+ dropped: granted no credit", log)


def _busy(answer: Any) -> bool:
    return isinstance(answer, Error) and answer.code == "busy"


@pytest.mark.timeout(90)
def test_sessions_that_granted_once_and_read_nothing_give_their_places_to_newcomers(
    sample_dataset: Path, start_serve, zmq_context
) -> None:
    # Four places, one per address by default ((4 - 1) // 2): four stalled clients fill them.
    server = start_serve(sample_dataset, "--batch-size", "1000", "--hwm", "2", "--max-clients", "4",
                         "--max-client-heartbeat", str(GRACE), "--heartbeat", "0.2")
    stalled = [Peer(zmq_context, server.port, source=f"127.0.0.{2 + i}") for i in range(4)]
    honest = None
    try:
        for i, peer in enumerate(stalled):
            # Each reads the batches of its Hello's credit and grants credit for them once more;
            # then it reads nothing (it heartbeats, so only credit tells it from a working client).
            peer.send(Hello(f"stalled-{i}", credit=2, heartbeat=GRACE))
            assert isinstance(peer.answer(), Welcome)
            assert [type(peer.answer()) for _ in range(2)] == [Batch, Batch]
            peer.send(Credit(2))
        full_at = time.monotonic()
        attempts, honest = hello_until_welcomed(
            zmq_context, server.port, Hello("honest", credit=2, heartbeat=GRACE),
            meanwhile=lambda: [peer.send(Heartbeat()) for peer in stalled], timeout=15.0)
        assert _busy(attempts[0]) and "4 sessions (--max-clients)" in attempts[0].message, attempts[0]
        assert honest is not None, f"no newcomer welcomed in 15s: {attempts[-3:]}"
        waited = time.monotonic() - full_at
        assert waited >= GRACE / 2, f"welcomed {waited:.1f}s after the server was full: {attempts[:3]}"
        assert isinstance(honest.answer(), Batch)
        # The longest stalled gave its place, and was told why.
        bye = _told_bye(stalled[0])
        assert bye is not None and "granted no credit" in bye.reason and "none left" in bye.reason, bye
        # A newcomer over its own address's cap takes that address's stalled session (once it has
        # stalled for the grace), though another stalled longer: 127.0.0.4 gives up stalled-2,
        # not stalled-1.
        attempts, third = hello_until_welcomed(
            zmq_context, server.port, Hello("from-4", credit=2, heartbeat=GRACE),
            meanwhile=lambda: [peer.send(Heartbeat()) for peer in [*stalled[1:], honest]], timeout=15.0,
            source="127.0.0.4")
        assert third is not None, f"no newcomer from 127.0.0.4 welcomed in 15s: {attempts[-3:]}"
        third.close()
        assert isinstance(_told_bye(stalled[2]), Bye)
    finally:
        for peer in [*stalled, *([honest] if honest else [])]:
            peer.close()
    assert _given_up(server.log()) == ["stalled-0", "stalled-2"], server.log()[-3000:]


# A Fuel-style source whose every batch after a session's first takes 30 s to prepare (a slow user
# stage), served with two places and a grace of GRACE seconds.
SLOW_SERVER = f"""
import logging
import threading
import numpy as np
from fuelline.server.serving.server import Server
from fuelline.server.serving.start import serve_until_signalled
from fuelline.server.sources.contract import BatchSource

class Slow(BatchSource):
    sources = ("sample_id",)
    splits = ("train",)

    def schema(self):
        return {{"sample_id": {{"dtype": "<i8", "shape": []}}}}

    def info(self, split):
        return {{"rows": 20 * 64}}

    def fingerprint(self, split):
        return {{"batches": "20"}}

    def batches_per_epoch(self, split, rank, world_size):
        return 20

    def iter_batches(self, split, epoch, rank, world_size, start, sources, on_loss=None, history=()):
        for i in range(start, 20):
            if i > start:
                threading.Event().wait(30.0)
            yield {{"sample_id": np.arange(i * 64, (i + 1) * 64, dtype=np.int64)}}

    def close(self):
        pass

logging.basicConfig(level=logging.INFO)  # (sessions given up are logged at INFO)
server = Server(Slow(), port=0, hwm=2, heartbeat=0.2, max_clients=2, max_client_heartbeat={GRACE},
                local_ipc=False)
serve_until_signalled(server)
"""


@pytest.mark.timeout(90)
def test_a_session_whose_batches_are_slow_to_prepare_keeps_its_place(start_script, zmq_context) -> None:
    server = start_script(SLOW_SERVER)
    # Waiting: granted 2, was sent 1; its next batch is still being prepared. It waits on the
    # server, and longer than the stalled one: it granted first.
    waiting = Peer(zmq_context, server.port, source="127.0.0.2")
    stalled = Peer(zmq_context, server.port, source="127.0.0.3")
    newcomer = None
    try:
        waiting.send(Hello("waiting", credit=2, heartbeat=GRACE))
        assert isinstance(waiting.answer(), Welcome) and isinstance(waiting.answer(), Batch)
        # Stalled: granted 1, was sent it, reads nothing more.
        stalled.send(Hello("stalled", credit=1, heartbeat=GRACE))
        assert isinstance(stalled.answer(), Welcome) and isinstance(stalled.answer(), Batch)
        full_at = time.monotonic()
        attempts, newcomer = hello_until_welcomed(
            zmq_context, server.port, Hello("newcomer", credit=1, heartbeat=GRACE),
            meanwhile=lambda: [peer.send(Heartbeat()) for peer in (waiting, stalled)], timeout=15.0)
        assert _busy(attempts[0]) and "2 sessions (--max-clients)" in attempts[0].message, attempts[0]
        assert newcomer is not None, f"no newcomer welcomed in 15s: {attempts[-3:]}"
        assert time.monotonic() - full_at >= GRACE / 2, attempts[:3]
        assert isinstance(newcomer.answer(), Batch)
        assert isinstance(_told_bye(stalled), Bye)
        # The session waiting on the server was not told to go, and still is served: nothing but
        # heartbeats come to it while its batch is prepared.
        waiting.send(Heartbeat())
        assert waiting.answer(1.0) is None
    finally:
        for peer in [waiting, stalled, *([newcomer] if newcomer else [])]:
            peer.close()
    assert _given_up(server.log()) == ["stalled"], server.log()[-3000:]


@pytest.mark.timeout(90)
def test_a_paused_reader_told_bye_reconnects_and_reads_its_exact_epoch(sample_dataset: Path, start_serve,
                                                                       zmq_context) -> None:
    # One place. The reader's user pauses (a long evaluation, say) with its hwm of batches held:
    # its session stalls, and a newcomer (that leaves at once) takes the place. The reader is
    # told Bye, reconnects, and once its user goes on reads the rest of its epoch, exactly.
    server = start_serve(sample_dataset, "--batch-size", "1000", "--hwm", "2", "--max-clients", "1",
                         "--max-client-heartbeat", str(GRACE), "--heartbeat", "0.2")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=2, local=False, timeout=30.0,
                          receive_timeout=30.0, client_id="paused") as stream:
        epoch = stream.get_epoch_iterator()
        ids = [next(epoch)[0] for _ in range(2)]
        attempts, newcomer = hello_until_welcomed(
            zmq_context, server.port, Hello("newcomer", credit=1, heartbeat=GRACE), meanwhile=lambda: None,
            timeout=15.0, source="127.0.0.2", leave=True)
        assert _busy(attempts[0]), attempts[0]
        assert newcomer is not None, f"no newcomer welcomed in 15s: {attempts[-3:]}"
        newcomer.close()
        server.wait_log(r"client paused#\w+ dropped: granted no credit in [\d.]+s and has none left")
        ids += [batch for (batch,) in epoch]
        reconnects = stream.reconnects
    got = np.concatenate(ids)
    assert np.array_equal(np.sort(got), np.arange(8000)), f"{len(got)} rows, {len(np.unique(got))} distinct"
    assert reconnects >= 1


@pytest.mark.timeout(90)
def test_a_reader_given_up_on_a_server_still_full_asks_again_until_a_place_frees(
        sample_dataset: Path, start_serve, zmq_context, caplog: pytest.LogCaptureFixture) -> None:
    # As above, but the newcomer stays (it reads its one batch and then nothing): the reader's
    # Hellos are refused busy, which for a client welcomed before is a place to wait for (within
    # its timeout), not an end. Once the newcomer has stalled in turn for the grace, the reader
    # takes the place back and reads the rest of its epoch, exactly.
    server = start_serve(sample_dataset, "--batch-size", "1000", "--hwm", "2", "--max-clients", "1",
                         "--max-client-heartbeat", str(GRACE), "--heartbeat", "0.2")
    caplog.set_level(logging.WARNING, logger="fuelline.client")
    newcomer = None
    try:
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=2, local=False, timeout=30.0,
                              receive_timeout=30.0, client_id="paused") as stream:
            epoch = stream.get_epoch_iterator()
            ids = [next(epoch)[0] for _ in range(2)]
            _, newcomer = hello_until_welcomed(
                zmq_context, server.port, Hello("newcomer", credit=1, heartbeat=GRACE), meanwhile=lambda: None,
                timeout=15.0, source="127.0.0.2")
            assert newcomer is not None
            ids += [batch for (batch,) in epoch]
            reconnects = stream.reconnects
    finally:
        if newcomer is not None:
            newcomer.close()
    got = np.concatenate(ids)
    assert np.array_equal(np.sort(got), np.arange(8000)), f"{len(got)} rows, {len(np.unique(got))} distinct"
    assert any("is full" in r.getMessage() and "asking again" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert reconnects >= 1
    assert _given_up(server.log()) == ["paused", "newcomer"], server.log()[-3000:]


@pytest.mark.timeout(60)
def test_a_job_restarted_at_once_is_not_locked_out_by_the_sessions_of_its_killed_processes(
    sample_dataset: Path, start_serve, zmq_context
) -> None:
    """Four trainers fill a full server's places, read their batches and are killed with their
    connections open; the job starts again at once. Their sessions have no credit left and the
    server, with a heartbeat of 30 s, would not send them anything for that long, nor notice their
    silence for longer: yet the restarted trainer is welcomed within moments, for libzmq knows the
    old connections are closed and the server asks it before it refuses anyone. (Its first Hello
    may still come before libzmq has seen the connections close: it asks again, from a new
    connection, as a client given a place later would.)"""
    server = start_serve(sample_dataset, "--batch-size", "1000", "--hwm", "2", "--max-clients", "4",
                         "--max-clients-per-peer", "4", "--heartbeat", "30")
    killed = [Peer(zmq_context, server.port, source=f"127.0.0.{2 + i}") for i in range(4)]
    for i, peer in enumerate(killed):
        peer.send(Hello(f"trainer-{i}", credit=2, heartbeat=30.0))
        assert isinstance(peer.answer(), Welcome)
        assert [type(peer.answer()) for _ in range(2)] == [Batch, Batch]
    for peer in killed:
        peer.close()  # (what the kernel does with a killed process's sockets: the connections close)
    closed_at = time.monotonic()
    attempts, restarted = hello_until_welcomed(
        zmq_context, server.port, Hello("trainer-0-restarted", credit=2, heartbeat=30.0),
        meanwhile=lambda: None, timeout=5.0, source="127.0.0.2")
    try:
        assert restarted is not None, attempts[-3:]
        assert time.monotonic() - closed_at < 5.0  # (the server's own heartbeat would take 30 s)
    finally:
        if restarted is not None:
            restarted.close()
    assert "disconnected" in server.wait_log(r"dropped: disconnected")
