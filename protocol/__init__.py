"""The fuelline wire format: messages, their encoding, limits and errors. No sockets, no threads.

See ``fuelline.protocol.codec`` for the frame layout and ``fuelline.protocol.messages`` for the
conversation between a client and a server.
"""

from fuelline.protocol.arrays import DEFAULT_LIMITS, WIRE_DTYPES, ArrayMeta, Limits
from fuelline.protocol.codec import decode, encode, peek_type
from fuelline.protocol.errors import (
    CheckpointError,
    ChecksumMismatch,
    DataError,
    FingerprintMismatch,
    FuellineError,
    MessageTooLarge,
    OptionError,
    ProtocolError,
    ProtocolVersionError,
    ReceiveTimeout,
    RemoteError,
    ServerUnavailable,
    WorkerError,
)
from fuelline.protocol.messages import (
    VERSION,
    Batch,
    Bye,
    Credit,
    EndOfEpoch,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Message,
    Welcome,
)

__all__ = [
    "VERSION", "Limits", "DEFAULT_LIMITS", "WIRE_DTYPES", "ArrayMeta",
    "encode", "decode", "peek_type",
    "Hello", "Welcome", "Credit", "Batch", "EndOfEpoch", "Heartbeat", "Error", "Bye", "Message", "ErrorCode",
    "FuellineError", "ProtocolError", "ProtocolVersionError", "MessageTooLarge", "ChecksumMismatch",
    "RemoteError", "ServerUnavailable", "ReceiveTimeout", "DataError", "FingerprintMismatch",
    "OptionError", "WorkerError", "CheckpointError",
]
