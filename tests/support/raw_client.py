"""A client that speaks the wire protocol by hand, to drive a server message by message."""

from __future__ import annotations

import time

import zmq

from fuelline.protocol import decode, encode

__all__ = ["RawClient"]


class RawClient:
    """A DEALER that speaks the protocol by hand, so tests see exactly what the server sends."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{endpoint}")

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def recv(self, timeout: float = 10.0):
        assert self.sock.poll(timeout * 1000), f"nothing from the server in {timeout}s"
        return decode(self.sock.recv_multipart(copy=False))

    def recv_for(self, seconds: float) -> list:
        """Everything that arrives within a window (for asserting what does *not* arrive)."""
        out = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(left * 1000):
                out.append(decode(self.sock.recv_multipart(copy=False)))
        return out
