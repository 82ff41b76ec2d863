"""The exceptions of fuelline, in one place.

::

    FuellineError
     ├── ProtocolError (ValueError)       a message that breaks the wire format
     │    ├── ProtocolVersionError        the peer speaks another protocol version
     │    ├── MessageTooLarge             a header, frame count or array above the hard limits
     │    └── ChecksumMismatch            an array frame whose bytes disagree with its checksum
     ├── RemoteError                      the peer refused a request (carries its error code)
     ├── ServerUnavailable (ConnectionError)
     │                                    no answer from an endpoint within the client's timeout
     ├── ReceiveTimeout (TimeoutError)    a live server sent no batch within receive_timeout
     └── DataError (ValueError)           bad input data or options: names the file, column, line

Builtins are subclassed where callers would catch the builtin: a ``ServerUnavailable`` is a
``ConnectionError``, a ``ReceiveTimeout`` a ``TimeoutError``.
"""

from __future__ import annotations

__all__ = [
    "FuellineError",
    "ProtocolError",
    "ProtocolVersionError",
    "MessageTooLarge",
    "ChecksumMismatch",
    "RemoteError",
    "ServerUnavailable",
    "ReceiveTimeout",
    "DataError",
]


class FuellineError(Exception):
    """Base class of every error fuelline raises on purpose."""


class ProtocolError(FuellineError, ValueError):
    """A message that does not follow the wire format."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks another protocol version."""

    def __init__(self, got: object, expected: int, peer: str | None = None) -> None:
        self.got = got
        self.expected = expected
        self.peer = peer
        where = f" from {peer}" if peer else ""
        super().__init__(f"protocol version {got!r}{where}, expected {expected}")


class MessageTooLarge(ProtocolError):
    """A header, a frame count or an array exceeds the hard limits."""


class ChecksumMismatch(ProtocolError):
    """An array frame's bytes disagree with the checksum in its header."""


class RemoteError(FuellineError):
    """The peer answered a request with an error message.

    Attributes:
        code: the machine-readable error code (see ``fuelline.protocol.ErrorCode``).
        peer: the endpoint that sent it, where known.
    """

    def __init__(self, code: str, message: str, peer: str | None = None) -> None:
        self.code = code
        self.message = message
        self.peer = peer
        where = f"{peer}: " if peer else ""
        super().__init__(f"{where}{message} [{code}]")


class ServerUnavailable(FuellineError, ConnectionError):
    """No answer from a data server within the client's timeout."""

    def __init__(self, endpoint: str, waited: float, detail: str = "") -> None:
        self.endpoint = endpoint
        self.waited = waited
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"no answer from data server {endpoint} for {waited:.1f}s{extra}; "
            "is `fuelline serve` running there and reachable?"
        )


class ReceiveTimeout(FuellineError, TimeoutError):
    """A live server delivered no batch within the client's receive_timeout."""


class DataError(FuellineError, ValueError):
    """Bad input data or options; the message names the file, column, line or option."""
