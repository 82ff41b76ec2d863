"""Admission caps: idle and silent connections never lock an honest client out, a Hello over a
cap is refused busy naming the cap, no two addresses fill a server, and idle sessions make room
for a newcomer.

DESIGN.md (Safety): sessions, threads and memory are bounded by the server's own caps, whatever
peers send or claim (credit, heartbeat, world size). Each test attacks a real server process over
loopback, checks the bound the attack used to break, and that an honest client reading at the
same time gets its exact epoch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import Batch, Bye, Credit, Error, Heartbeat, Hello, Welcome

from support.admission import REPLY_WAIT, Peer, welcome_all


def _read_and_grant(peers: list[Peer]) -> None:
    """Working clients: each takes the batches that came and grants credit for them again."""
    for peer in peers:
        taken = 0
        while (msg := peer.recv(0.0)) is not None:
            taken += isinstance(msg, Batch)
        peer.send(Credit(taken) if taken else Heartbeat())


# -- connections that say Hello and nothing more ------------------------------------------------
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


@pytest.mark.timeout(120)
def test_with_the_default_caps_two_addresses_cannot_fill_the_server(sample_dataset: Path, start_serve,
                                                                    zmq_context) -> None:
    # The default --max-clients (256) and per-address cap; sessions that read (granted credit),
    # and a grace longer than the test, so that the caps alone decide.
    server = start_serve(sample_dataset, "--batch-size", "1000", "--hwm", "1", "--max-client-heartbeat", "600")
    peers: list[Peer] = []
    welcomed: dict[str, int] = {}
    try:
        for source in ("127.0.0.2", "127.0.0.3"):
            # Each address opens sessions until it is refused (at most as many as the server has).
            welcomed[source] = 0
            while welcomed[source] < 256:
                peers.append(Peer(zmq_context, server.port, source=source))
                peers[-1].send(Hello(f"{source}-{welcomed[source]}", credit=1, heartbeat=600.0))
                answer = peers[-1].answer()
                if not isinstance(answer, Welcome):
                    break
                welcomed[source] += 1
            assert isinstance(answer, Error) and answer.code == "busy", answer
            assert f"127 sessions from {source} (--max-clients-per-peer)" in answer.message, answer.message
        assert welcomed == {"127.0.0.2": 127, "127.0.0.3": 127}
        # Fewer than half each: a third address still finds a place.
        third = Peer(zmq_context, server.port, source="127.0.0.4")
        peers.append(third)
        third.send(Hello("third", credit=1, heartbeat=600.0))
        assert isinstance(third.answer(), Welcome) and isinstance(third.answer(), Batch)
    finally:
        for peer in peers:
            peer.close()


@pytest.mark.timeout(60)
def test_idle_sessions_make_room_for_a_newcomer_and_working_ones_do_not(sample_dataset: Path, start_serve,
                                                                       zmq_context) -> None:
    grace = 2.0
    server = start_serve(sample_dataset, "--max-clients", "3", "--max-clients-per-peer", "3",
                         "--max-client-heartbeat", str(grace), "--heartbeat", "0.1", "--hwm", "2")
    working = Peer(zmq_context, server.port)
    idle = [Peer(zmq_context, server.port) for _ in range(2)]
    honest = Peer(zmq_context, server.port)
    attempts: list[Any] = []
    try:
        working.send(Hello("working", credit=1, heartbeat=grace))
        assert isinstance(working.answer(), Welcome) and isinstance(working.answer(), Batch)
        working.send(Credit(1))  # it works: it grants credit for each batch it takes
        for i, peer in enumerate(idle):  # one after the other (two connections' Hellos may cross): idle-0 is older
            peer.send(Hello(f"idle-{i}", credit=0, heartbeat=grace))
            assert isinstance(peer.answer(), Welcome)
        _read_and_grant([working])
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
            _read_and_grant([working, honest])  # all alive: only credit (or its absence) tells them apart
            idle[1].send(Heartbeat())
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
        _read_and_grant([working, honest])
        late.send(Hello("late", credit=2, heartbeat=grace))
        assert isinstance(late.answer(), Welcome)
        later = Peer(zmq_context, server.port)
        _read_and_grant([working, honest])
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
