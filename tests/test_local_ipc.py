"""A client on the server's own host moves from TCP to the Unix socket the server offers."""

from __future__ import annotations

import os
from pathlib import Path

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
