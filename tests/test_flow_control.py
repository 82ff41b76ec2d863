"""Credit-based flow control and heartbeats, checked on the wire with a hand-driven client."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from fuelline.protocol import Batch, Credit, EndOfEpoch, Heartbeat, Hello, encode

from support.raw_client import RawClient


@pytest.fixture
def server(sample_dataset: Path, start_serve):
    return start_serve(sample_dataset, "--batch-size", "10", "--hwm", "4", "--heartbeat", "0.2")


def test_server_never_exceeds_the_clients_credit(server, zmq_context: zmq.Context) -> None:
    client = RawClient(zmq_context, server.endpoint)
    client.send(Hello("raw", credit=3, heartbeat=5.0))
    assert client.recv().TYPE == "welcome"
    # Over a window of 5 server heartbeats, exactly 3 batches arrive, then only heartbeats.
    got = client.recv_for(1.0)
    batches = [m for m in got if isinstance(m, Batch)]
    assert [b.seq for b in batches] == [0, 1, 2]
    assert any(isinstance(m, Heartbeat) for m in got), "an idle server must send heartbeats"
    client.send(Credit(2))
    got = client.recv_for(0.6)
    assert [m.seq for m in got if isinstance(m, Batch)] == [3, 4]


def test_server_hwm_caps_in_flight_even_with_more_credit(server, zmq_context: zmq.Context) -> None:
    client = RawClient(zmq_context, server.endpoint)
    client.send(Hello("greedy", credit=100, heartbeat=5.0))
    assert client.recv().TYPE == "welcome"
    got = [m for m in client.recv_for(0.8) if isinstance(m, Batch)]
    assert len(got) == 4  # --hwm 4: never more in flight, whatever the client grants
    client.send(Credit(1))  # one consumed: one more may come
    assert len([m for m in client.recv_for(0.5) if isinstance(m, Batch)]) == 1


def test_epoch_ends_with_end_of_epoch_after_every_batch(server, zmq_context: zmq.Context) -> None:
    client = RawClient(zmq_context, server.endpoint)
    client.send(Hello("counter", split="val", heartbeat=5.0, credit=4))
    welcome = client.recv()
    seqs = []
    while True:
        msg = client.recv()
        if isinstance(msg, Batch):
            seqs.append(msg.seq)
            client.send(Credit(1))
        elif isinstance(msg, EndOfEpoch):
            break
    assert seqs == list(range(welcome.batches_per_epoch)) and msg.batches == 200 and msg.epoch == 0


def test_silent_client_is_dropped_after_three_intervals(server, zmq_context: zmq.Context) -> None:
    client = RawClient(zmq_context, server.endpoint)
    client.send(Hello("mute", credit=1, heartbeat=0.2))
    assert client.recv().TYPE == "welcome"
    text = server.wait_log(r"client mute#\w+ dropped: silent for 0\.[6-9]\d*s", timeout=5.0)
    assert "its buffers are freed" in text
    # Once dropped, the server says so to anything the connection sends.
    client.send(Heartbeat())
    reply = [m for m in client.recv_for(1.0) if m.TYPE == "error"]
    assert reply and reply[0].code == "no-session" and not reply[0].fatal


def test_client_heartbeats_keep_a_slow_consumer_alive(sample_dataset: Path, start_serve) -> None:
    from fuelline.client import ServerDataStream

    server = start_serve(sample_dataset, "--batch-size", "10", "--heartbeat", "0.1")
    with ServerDataStream(endpoints=[server.endpoint], heartbeat=0.1, hwm=2, timeout=10) as s:
        it = s.get_epoch_iterator()
        first = next(it)
        time.sleep(1.0)  # a slow training step: 10 heartbeat intervals without taking a batch
        second = next(it)
    assert first[0].tolist() != second[0].tolist()
    assert "dropped: silent" not in server.log()


def test_garbage_does_not_take_the_server_down(server, zmq_context: zmq.Context) -> None:
    client = RawClient(zmq_context, server.endpoint)
    for frames in ([os.urandom(50)], [b""], [os.urandom(10), os.urandom(3000)], [b"\x81\xa1t\xa5hello"]):
        client.sock.send_multipart(frames)
        reply = client.recv()
        assert reply.TYPE == "error" and reply.code in ("malformed", "version")
    # A batch sent to the server is not a request a client may make.
    client.sock.send_multipart(encode(Batch(0, 0, 0, {})))
    assert client.recv().code == "bad-request"
    client.send(Hello("after-garbage", credit=2, heartbeat=0.2))
    assert client.recv().TYPE == "welcome"
    # (On a busy host the first batch may take longer than the server's heartbeat of 0.2 s to
    # prepare: heartbeats come before it then.)
    msg = client.recv()
    while isinstance(msg, Heartbeat):
        msg = client.recv()
    assert isinstance(msg, Batch)


def test_the_server_logs_a_status_line_per_interval(sample_dataset: Path, start_serve) -> None:
    from fuelline.client import ServerDataStream

    server = start_serve(sample_dataset, "--batch-size", "100", "--status-interval", "0.2")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=10) as s:
        assert len(list(s.get_epoch_iterator())) == 80
        # (wait_log fails the test if no such line appears: a client, and batches flowing.)
        server.wait_log(r"1 client; [1-9][\d.]* batches/s, [\d.]+ MB/s; \d+ batches prepared", timeout=5)
