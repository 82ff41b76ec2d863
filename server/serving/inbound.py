"""What a client may send the server, read at the cost of its header alone.

A client sends only control messages (Hello, Credit, Heartbeat, Bye), one frame each. The serving
loop receives with ``copy=False``, so a message's frames stay in libzmq's buffers, and a message of
several frames is judged by its header frame and the other frames' lengths: their bytes are never
copied, checksummed or read. A peer that sends hundreds of megabytes of frames costs the server
their transfer and nothing more, and the honest clients beside it lose no time to it.
"""

from __future__ import annotations

from typing import Any, Sequence

from fuelline.protocol import Limits, Message, MessageTooLarge, decode

__all__ = ["MAX_INBOUND_BYTES", "decode_request"]

# Clients send only small control messages: libzmq disconnects a peer whose frame is bigger. It
# caps each frame, not a whole multipart message (libzmq has no such option), so a hostile peer can
# still make libzmq hold many frames until the message is complete; off loopback, CURVE keeps
# strangers out altogether.
MAX_INBOUND_BYTES = 1 << 20

# Zeros that stand in for a message's extra frames: the decoder checks a batch header's arrays
# against frames of the same lengths, and reads no byte a peer sent. (calloc'd: untouched pages
# cost no memory.)
_STAND_IN = memoryview(bytearray(MAX_INBOUND_BYTES))


def _stand_in(frame: Any) -> memoryview:
    size = len(frame)
    if size > len(_STAND_IN):
        raise MessageTooLarge(f"a frame of {size} bytes exceeds the limit of {len(_STAND_IN)}")
    return _STAND_IN[:size]


def decode_request(body: Sequence[Any], limits: Limits) -> Message:
    """Decode a client's message from its frames (``zmq.Frame`` or bytes).

    A message of several frames is never a request, and what is wrong with it is told by its
    header: another version, a header that lists no such frames (malformed), or a well-formed
    Batch, which only a server may send. It comes back decoded on stand-ins of its frames' lengths.

    Raises:
        ProtocolVersionError, MessageTooLarge, ProtocolError: as ``fuelline.protocol.decode``.
    """
    if len(body) <= 1:
        return decode(body, limits=limits)
    if len(body) > limits.max_arrays + 1:
        raise MessageTooLarge(f"{len(body)} frames exceed the limit of {limits.max_arrays + 1}")
    return decode([body[0], *(_stand_in(f) for f in body[1:])], limits=limits, verify=False)
