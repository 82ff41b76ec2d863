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
     ├── DataError (ValueError)           bad input data or options: names the file, column, line
     │    ├── OptionError                 an argument out of range: names the argument (a command
     │    │                               line names its flag instead)
     │    └── FingerprintMismatch         a server would not continue the same sequence: names
     │                                    what differs (seed, files, batch size...) and where
     ├── WorkerError                      a server's worker process failed other than on bad data
     │    └── WorkerPoolBroken            (fuelline.server.workers) workers died too often
     └── CheckpointError (RuntimeError)   a trainer checkpoint that cannot be loaded safely

Builtins are subclassed where callers would catch the builtin: a ``ServerUnavailable`` is a
``ConnectionError``, a ``ReceiveTimeout`` a ``TimeoutError``.
"""

from __future__ import annotations

from typing import Mapping

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
    "OptionError",
    "FingerprintMismatch",
    "WorkerError",
    "CheckpointError",
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


class OptionError(DataError):
    """An argument out of its range. The message names the argument as a Python caller spells it
    (``batch_size must be >= 1, got 0``); a command line re-words it with its flag.

    Attributes:
        option: the argument's name (``batch_size``).
        rule: the rest of the message (``must be >= 1, got 0``).
    """

    def __init__(self, option: str, rule: str) -> None:
        super().__init__(f"{option} {rule}")
        self.option = option
        self.rule = rule

    def __reduce__(self) -> tuple:  # (crosses from worker processes)
        return type(self), (self.option, self.rule)


class WorkerError(FuellineError):
    """A server's worker process raised something other than DataError (a bug, most likely), or
    the pool closed while a task waited. The worker's traceback is the ``__cause__``."""


class CheckpointError(FuellineError, RuntimeError):
    """A trainer checkpoint that cannot be loaded (unreadable, or holding more than plain data)."""


class FingerprintMismatch(DataError):
    """A server's sequence fingerprint differs from the one a reader holds to: batch positions
    there would mean other batches, so reading on would repeat and skip samples.

    Attributes:
        pinned, got: the two fingerprints (``got`` is None for a server that sends none).
        pinned_at, got_at: where each comes from, as the message says it ("in the saved
            position", "at tcp://host:port").
        context: what the message starts with (which servers were compared).
        differences: the names of the parts that differ, sorted.
    """

    def __init__(
        self, pinned: Mapping[str, str], got: Mapping[str, str] | None, pinned_at: str, got_at: str,
        context: str = "",
    ) -> None:
        self.pinned = dict(pinned)
        self.got = None if got is None else dict(got)
        self.pinned_at = pinned_at
        self.got_at = got_at
        self.context = context
        if self.got is None:
            self.differences = sorted(self.pinned)
            detail = (f"the server {got_at} sends no sequence fingerprint, so nothing shows that it "
                      f"continues the sequence {pinned_at}")
        else:
            theirs = self.got
            self.differences = sorted(k for k in {*self.pinned, *theirs} if self.pinned.get(k) != theirs.get(k))
            detail = "; ".join(
                f"{k} is {_part(self.pinned, k)} {pinned_at} and {_part(theirs, k)} {got_at}" for k in self.differences
            )
        advice = "serve the same files with the same options"
        if (self.got is not None and "order" in self.differences and (self.pinned.get("order") or "").isdigit()
                and self.pinned.get("shuffle") == self.got.get("shuffle") == "true"):
            # (A server of a newer release serves an older order on request.)
            advice += f" (`fuelline serve --order-version {self.pinned['order']}` serves order {self.pinned['order']})"
        super().__init__(
            f"{context}{detail}: positions there mean other batches, so none of its batches is delivered; {advice}"
        )

    def __reduce__(self) -> tuple:
        # Rebuilt from its parts, not its message, when it crosses a process boundary.
        return type(self), (self.pinned, self.got, self.pinned_at, self.got_at, self.context)


def _part(fingerprint: Mapping[str, str], key: str) -> str:
    return repr(fingerprint[key]) if key in fingerprint else "absent"
