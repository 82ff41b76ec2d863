"""Messages lost in transit are asked for again; a Hello lost with its server is sent again.

A TCP connection reset in mid-transfer is reconnected by libzmq under the same routing id, so the
server carries on with the same session while what was queued on the old connection is gone. The
client notices a gap in the batch sequence, or a server heartbeat that counts more than arrived,
and asks again from its next undelivered batch. A Hello a server read just before it died is never
answered by the server that replaces it, which only says no-session to heartbeats: the client
counts the missing Welcome as silence and connects again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol import Hello, decode

from support.processes import wait_until
from support.tcp_proxy import TcpProxy

TIMEOUT = 20.0
ARGS = ("--batch-size", "100", "--hwm", "4", "--seed", "3")


def _ids(stream: ServerDataStream) -> list[int]:
    return [int(i) for (batch,) in stream.get_epoch_iterator() for i in batch]


def _cut_while(proxy: TcpProxy, action: Callable[[], Any]) -> tuple[int, Any]:
    """Arm a cut for the server's next chunk, then do ``action``; (connections cut, its result)."""
    cut: list[int] = []
    cutting = threading.Thread(target=lambda: cut.append(proxy.cut(in_flight=True, within=5.0)), daemon=True)
    cutting.start()
    wait_until(lambda: proxy.armed or not cutting.is_alive(), TIMEOUT, "the proxy armed for a cut")
    result = action()
    cutting.join(TIMEOUT)
    assert not cutting.is_alive() and cut, "the cut did not happen"
    return cut[0], result


def test_batches_lost_in_a_reset_in_mid_transfer_are_asked_for_again(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, *ARGS)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=4, timeout=TIMEOUT, local=False) as s:
        reference = _ids(s)
    with TcpProxy(server.port, lifetime=120.0) as proxy:
        with ServerDataStream(("sample_id",), host="127.0.0.1", port=proxy.port, hwm=4, heartbeat=0.2,
                              timeout=TIMEOUT, receive_timeout=TIMEOUT, local=False) as stream:
            it = stream.get_epoch_iterator()
            got = [int(i) for _ in range(3) for i in next(it)[0]]
            cuts = 0
            for _ in range(3):  # a cut that meets a chunk of a batch loses it with the connection
                # Armed first, then a batch taken: its credit makes the server send the next one,
                # which the cut meets. (Armed after the take, the cut could find the credit's batch
                # already through, and meet only a heartbeat.)
                cut, batch = _cut_while(proxy, lambda: next(it))
                cuts += cut
                got += [int(i) for i in batch[0]]
            got += [int(i) for (batch,) in it for i in batch]
            (conn,) = stream._conns  # noqa: SLF001
            assert cuts >= 3 and conn.resumes_after_loss >= 1, (cuts, conn.resumes_after_loss)
    assert got == reference  # nothing lost, nothing repeated, in order


def test_a_hello_lost_with_its_server_is_sent_again_to_the_next(sample_dataset: Path, start_serve, zmq_context) -> None:
    # A peer that reads the Hello and dies stands in for a server killed between reading a Hello
    # and answering it; a real server then starts on the same port.
    dead = zmq_context.socket(zmq.ROUTER)
    dead.setsockopt(zmq.LINGER, 0)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    stream = ServerDataStream(("sample_id",), host="127.0.0.1", port=port, hwm=4, heartbeat=0.2,
                              timeout=TIMEOUT, receive_timeout=TIMEOUT, local=False)
    try:
        stream._connections()  # noqa: SLF001 (connects and sends the Hello)
        assert dead.poll(TIMEOUT * 1000), "no Hello arrived"
        assert isinstance(decode(dead.recv_multipart()[1:]), Hello)
        dead.close(linger=0)
        server = start_serve(sample_dataset, *ARGS, "--port", str(port))  # (the last --port counts)
        ids = _ids(stream)
    finally:
        stream.close()
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=4, timeout=TIMEOUT, local=False) as s:
        assert ids == _ids(s)



def test_a_lost_batch_that_held_all_the_credit_is_noticed_by_the_servers_heartbeat(sample_dataset: Path, start_serve) -> None:
    # With hwm 1 the lost batch is the only one in flight: no later batch shows a gap, and the
    # server, out of credit, only sends heartbeats. Their count of what was sent tells the client.
    server = start_serve(sample_dataset, *ARGS)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=1, timeout=TIMEOUT, local=False) as s:
        reference = _ids(s)
    with TcpProxy(server.port, lifetime=120.0) as proxy:
        with ServerDataStream(("sample_id",), host="127.0.0.1", port=proxy.port, hwm=1, heartbeat=0.2,
                              timeout=TIMEOUT, receive_timeout=TIMEOUT, local=False) as stream:
            it = stream.get_epoch_iterator()
            got = [int(i) for i in next(it)[0]]  # batch 1 is on its way once this one is taken
            (conn,) = stream._conns  # noqa: SLF001
            wait_until(lambda: len(conn._items) == 1, TIMEOUT, "batch 1 received")  # noqa: SLF001
            cuts: list[int] = []
            cutter = threading.Thread(target=lambda: cuts.append(proxy.cut(in_flight=True, within=10.0)))
            cutter.start()
            wait_until(lambda: proxy.armed, TIMEOUT, "the cut armed")
            got += [int(i) for i in next(it)[0]]  # its credit lets batch 2 go, into the cut
            cutter.join(TIMEOUT)
            got += [int(i) for (batch,) in it for i in batch]
            assert cuts == [1], cuts
            assert conn.resumes_after_loss >= 1 and conn.reconnects == 0, (conn.resumes_after_loss, conn.reconnects)
    assert got == reference
