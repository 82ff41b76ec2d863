"""The handshake monitor must never stall the client's zmq context.

libzmq sends monitor events from its I/O thread with a blocking send; an event for a monitor
whose reading end is gone blocks that thread for good, and with it every socket of the context
(new connections never happen, nothing more is received)."""

from __future__ import annotations

import zmq

from fuelline.client.curve import HandshakeWatch

TIMEOUT_MS = 5000


def test_events_after_detach_do_not_stall_the_context() -> None:
    ctx = zmq.Context()
    stuck = True
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        watched = ctx.socket(zmq.DEALER)
        watched.setsockopt(zmq.LINGER, 0)
        watch = HandshakeWatch(f"tcp://127.0.0.1:{port}", None)
        watch.attach(watched)
        watch.detach()
        # Events the monitor would have reported: connections and handshakes, several of them.
        for _ in range(20):
            watched.connect(f"tcp://127.0.0.1:{port}")
            watched.disconnect(f"tcp://127.0.0.1:{port}")
        watched.connect(f"tcp://127.0.0.1:{port}")
        other = ctx.socket(zmq.DEALER)
        other.setsockopt(zmq.LINGER, 0)
        other.connect(f"tcp://127.0.0.1:{port}")
        other.send(b"still alive")
        stuck = not router.poll(TIMEOUT_MS)
        assert not stuck, "the context's I/O thread is stuck"
        assert router.recv_multipart()[-1] == b"still alive"
        for sock in (watched, other, router):
            sock.close(linger=0)
    finally:
        if not stuck:  # (a stuck context cannot terminate: it is left behind rather than hang the suite)
            ctx.term()


def test_a_connected_client_stops_watching(sample_dataset, start_serve) -> None:
    from fuelline.client import ServerDataStream

    server = start_serve(sample_dataset, "--batch-size", "1000")
    with ServerDataStream(endpoints=[server.endpoint], timeout=10.0) as s:
        assert len(list(s.get_epoch_iterator())) == 8  # every batch came after a Welcome
        assert all(conn._watch._monitor is None for conn in s._conns)  # noqa: SLF001
