"""A client on the server's own host moves from TCP to the Unix socket the server offers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream

TIMEOUT = 20.0
ARGS = ("--batch-size", "500", "--seed", "5")


def epoch(endpoint: str, **options) -> tuple[list[list[int]], list[str]]:
    with ServerDataStream(("sample_id",), endpoints=[endpoint], timeout=TIMEOUT, **options) as s:
        ids = [b[0].tolist() for b in s.get_epoch_iterator()]
        return ids, s.transports


def test_a_local_client_reads_the_same_epoch_through_the_unix_socket(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, *ARGS)
    local, transports = epoch(server.endpoint)
    assert len(transports) == 1 and transports[0].startswith("ipc://") and transports[0].endswith("/server.sock")
    path = transports[0][len("ipc://"):]
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"  # this user's processes only
    tcp, transports = epoch(server.endpoint, local=False)
    assert transports == [f"tcp://{server.endpoint}"]
    assert local == tcp
    assert server.terminate() == 0
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))  # removed at shutdown


def test_a_server_can_keep_every_client_on_tcp(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, *ARGS, "--no-local-ipc")
    _, transports = epoch(server.endpoint)
    assert transports == [f"tcp://{server.endpoint}"]


def test_a_client_that_cannot_read_the_token_stays_on_tcp(sample_dataset: Path, start_serve, zmq_context) -> None:
    import zmq

    from fuelline.protocol import Hello, decode, encode

    server = start_serve(sample_dataset, *ARGS)
    sock = zmq_context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{server.endpoint}")
    sock.send_multipart(encode(Hello("peek", credit=1)))
    assert sock.poll(TIMEOUT * 1000)
    welcome = decode(sock.recv_multipart())
    token_file = welcome.local["endpoint"][len("ipc://"):] + ".token"
    assert open(token_file).read() == welcome.local["token"]
    os.chmod(token_file, 0o200)  # as if this client were another user: the token is unreadable
    if os.access(token_file, os.R_OK):  # (root reads anything: make it a different token instead)
        os.chmod(token_file, 0o600)
        with open(token_file, "w") as f:
            f.write("another host's token")
    _, transports = epoch(server.endpoint)
    assert transports == [f"tcp://{server.endpoint}"]


def test_after_a_restart_the_client_finds_the_new_socket(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, *ARGS)
    expected, _ = epoch(server.endpoint, local=False)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT, heartbeat=0.2, hwm=2) as s:
        it = s.get_epoch_iterator()
        got = [next(it)[0].tolist() for _ in range(3)]
        first = s.transports[0]
        server.kill()
        again = start_serve(sample_dataset, *ARGS, "--port", server.endpoint.rpartition(":")[2])
        got += [b[0].tolist() for b in it]
        assert s.transports[0].startswith("ipc://") and s.transports[0] != first
    assert got == expected
    assert again.endpoint == server.endpoint


@pytest.mark.parametrize("local", [True, False])
def test_a_hello_over_tcp_asks_for_batches_only_once_the_client_knows_it_stays(zmq_context, local: bool) -> None:
    """A client that may move to the server's Unix socket asks for nothing in its Hello over TCP
    (the server would prepare batches for a session the move replaces); when its Welcome offers
    no socket it can use, the credit follows. One that will not move asks at once."""
    import zmq

    from fuelline.protocol import Credit, Hello, Welcome, decode, encode

    router = zmq_context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with ServerDataStream(("x",), endpoints=[f"127.0.0.1:{port}"], hwm=6, timeout=5.0, local=local) as s:
        s.get_epoch_iterator()  # connects and says Hello
        assert router.poll(5000), "no Hello within 5 s"
        rid, *frames = router.recv_multipart()
        hello = decode(frames)
        assert isinstance(hello, Hello) and hello.credit == (0 if local else 6)
        welcome = Welcome("s", hello.stream, ("x",), {"x": {"dtype": "<f4", "shape": []}}, None, 1.0,
                          local={"endpoint": "ipc:///nonexistent/server.sock", "token": "not this host's"})
        router.send_multipart([rid, *encode(welcome)])
        if local:
            assert router.poll(5000), "no credit within 5 s of the Welcome"
            _, *frames = router.recv_multipart()
            credit = decode(frames)
            assert isinstance(credit, Credit) and credit.n == 6
        else:
            assert not router.poll(300), "a client that asked at once asked again"


def test_every_batch_a_local_client_is_sent_is_placed_in_shared_memory(sample_dataset: Path, start_serve) -> None:
    """End to end: none goes over its first, TCP, session (the Hello there asks for none; that it
    does is pinned down by test_a_hello_over_tcp_asks_for_batches_only_once_the_client_knows_it_stays,
    since a server may also just not get to it before the move)."""
    import re
    import urllib.request

    server = start_serve(sample_dataset, *ARGS, "--metrics-port", "0")
    port = int(re.search(r"metrics on http://127.0.0.1:(\d+)/metrics", server.log()).group(1))

    def counts() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as answer:
            text = answer.read().decode()
        return {name: float(v) for name, v in re.findall(r"^(fuelline_\w+(?:_total|_connected)) (\S+)$", text, re.M)}

    def once_every_client_left() -> dict[str, float]:
        """The counters once the server has ended every session: a reader's close tells the server
        (Bye), and until the server reads it, a batch prepared ahead may still go out."""
        deadline = time.monotonic() + TIMEOUT
        while (now := counts())["fuelline_clients_connected"]:
            assert time.monotonic() < deadline, f"sessions still open {TIMEOUT:.0f}s after their readers closed: {now}"
            time.sleep(0.05)
        return now

    ids, transports = epoch(server.endpoint)
    assert transports[0].startswith("ipc://") and len(ids) == 16
    after = once_every_client_left()
    # Every batch sent (the epoch's, and any read ahead into the next) was placed in shared memory.
    assert after["fuelline_sessions_total"] == 2  # (the Hello over TCP, then the one on the socket)
    assert after["fuelline_batches_sent_total"] == after["fuelline_batches_shared_total"] >= 16, after
    # Clients that do not move get the credit their Hello held back once the Welcome is read.
    for options in ({"shared_memory": False}, {"local": False}):
        ids, transports = epoch(server.endpoint, **options)
        assert len(ids) == 16, options
    assert once_every_client_left()["fuelline_batches_shared_total"] == after["fuelline_batches_shared_total"]


def test_a_client_whose_hwm_is_above_the_servers_and_that_stays_on_tcp_is_served(sample_dataset: Path, start_serve) -> None:
    """Its Hello over TCP holds its credit back, which it then grants after the Welcome: that is the
    Hello's credit, not credit returned for batches never sent, however large its hwm."""
    server = start_serve(sample_dataset, *ARGS, "--hwm", "2", "--no-local-ipc")  # (a Welcome with no socket)
    ids, transports = epoch(server.endpoint, hwm=16)
    assert transports == [f"tcp://{server.endpoint}"] and len(ids) == 16
