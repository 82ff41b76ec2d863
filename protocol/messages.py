"""The messages of the fuelline protocol, as frozen dataclasses.

Every message is a header frame (a msgpack map) and, for ``Batch`` only, one raw frame per
array. Each header carries ``v`` (the protocol version) and ``t`` (the message type); the other
keys are the dataclass fields below. Fields are validated in ``__post_init__``, so a message that
decodes is a message whose fields make sense.

Conversation (client = DEALER, server = ROUTER; the routing id identifies the connection)::

    client                                   server
    Hello(stream, epoch, cursor, credit) ──▶
                                         ◀── Welcome(stream, sources, schema, batches_per_epoch, fingerprint)
                                         ◀── Batch(stream, epoch, seq) × at most `credit` in flight
    Credit(n, released) ───────────────────▶ (one per batch the client has handed to its user)
                                         ◀── EndOfEpoch(stream, epoch, batches), then the next epoch
    Heartbeat ◀──────────────────────────▶ Heartbeat (whichever side has been idle for an interval)
    Hello(stream + 1, ...) ────────────────▶ restarts the stream at another position (seek)
    Bye ◀───────────────────────────────────▶ Bye (either side leaves; the server on shutdown)
                                         ◀── Error(code, message, fatal) for a request it refuses
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Union

import numpy as np

__all__ = [
    "VERSION",
    "ErrorCode",
    "Hello",
    "Welcome",
    "Credit",
    "Batch",
    "EndOfEpoch",
    "Heartbeat",
    "Error",
    "Bye",
    "Message",
    "MESSAGE_TYPES",
]

VERSION = 1
MAX_HISTORY_WORLD = 1 << 20  # most ranks a resume segment (Hello.history) may name
MAX_FINGERPRINT_PARTS = 64  # entries of Welcome.fingerprint
MAX_FINGERPRINT_KEY = 64  # characters of a part's name
MAX_FINGERPRINT_VALUE = 256  # characters of a part's value
MAX_RELEASED = 4096  # shared-memory regions one Credit may release


class ErrorCode:
    """Error codes a server sends in ``Error.code``."""

    VERSION = "version"  # the client speaks another protocol version
    MALFORMED = "malformed"  # the request could not be decoded
    BAD_REQUEST = "bad-request"  # decoded, but not a request a client may send
    NO_SESSION = "no-session"  # the server has no session for this connection: send Hello again
    UNKNOWN_SOURCE = "unknown-source"  # the client asked for a source the server does not have
    UNKNOWN_SPLIT = "unknown-split"  # the client asked for a split the dataset does not have
    DATA = "data"  # the server could not produce a batch (names the file)
    DATA_LOSS = "data-loss"  # not fatal: rows left out under --on-bad-shard skip (names the file)
    INTERNAL = "internal"  # a bug in the server; the message says where
    BUSY = "busy"  # the server is at a cap (sessions, sessions per address, threads); names it


def _check_int(owner: str, name: str, value: Any, minimum: int = 0) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r:.60}")


def _check_str(owner: str, name: str, value: Any, allow_empty: bool = False) -> None:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise ValueError(f"{owner}.{name} must be a {'' if allow_empty else 'non-empty '}string, got {value!r:.60}")


def _check_interval(owner: str, name: str, value: Any) -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 < value <= 3600:
        raise ValueError(f"{owner}.{name} must be seconds in (0, 3600], got {value!r:.60}")


def _check_names(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{owner}.{name} must be a tuple of non-empty strings, got {value!r:.100}")
    if len(set(value)) != len(value):
        raise ValueError(f"{owner}.{name} names a source twice: {value!r:.100}")


def _checked_fingerprint(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or len(value) > MAX_FINGERPRINT_PARTS:
        raise ValueError(f"Welcome.fingerprint must be a map of at most {MAX_FINGERPRINT_PARTS} parts, got {value!r:.60}")
    for k, v in value.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_FINGERPRINT_KEY:
            raise ValueError(f"Welcome.fingerprint part names must be strings of 1 to {MAX_FINGERPRINT_KEY} "
                             f"characters, got {k!r:.80}")
        if not isinstance(v, str) or len(v) > MAX_FINGERPRINT_VALUE:
            raise ValueError(f"Welcome.fingerprint part {k!r} must be a string of at most {MAX_FINGERPRINT_VALUE} "
                             f"characters, got {v!r:.80}")
    return dict(value)  # a plain dict: what msgpack encodes, whatever mapping it was given


@dataclass(frozen=True)
class Hello:
    """Client → server: start (or restart) a stream at a position.

    Attributes:
        client_id: stable identity of the client across reconnects (for logs and for replacing
            the session of a connection that died).
        rank, world_size: which share of every epoch this client reads.
        split: which split of the dataset (``"train"``, ``"val"``...).
        sources: the sources wanted, in the order the client wants them; None for all.
        stream: the client's stream counter; every Batch of this stream echoes it, so batches of
            an older stream still in flight can be told apart and dropped.
        epoch, cursor: the first batch wanted (the resume position).
        credit: how many batches the server may have in flight to this client.
        heartbeat: the client's heartbeat interval in seconds.
        history: the segments of ``epoch`` already run at other world sizes, oldest first:
            (world size, batches each rank took[, stride, extra]). Empty unless a position is
            resumed on another world size (see ``fuelline.server.sources.ordering.remaining_order``).
        shm: the client reads through the server's Unix socket and can map its slabs: the server
            may place batches in shared memory (``fuelline.protocol.placement``). Optional on the
            wire: a server that predates it sends every batch on the socket.
    """

    TYPE: ClassVar[str] = "hello"
    client_id: str
    rank: int = 0
    world_size: int = 1
    split: str = "train"
    sources: tuple[str, ...] | None = None
    stream: int = 0
    epoch: int = 0
    cursor: int = 0
    credit: int = 10
    heartbeat: float = 1.0
    history: tuple[tuple[int, ...], ...] = ()
    shm: bool = False

    def __post_init__(self) -> None:
        _check_str("Hello", "client_id", self.client_id)
        if type(self.shm) is not bool:
            raise ValueError(f"Hello.shm must be a bool, got {self.shm!r:.40}")
        if not isinstance(self.history, (list, tuple)) or len(self.history) > 64:
            raise ValueError("Hello.history must be a list of at most 64 resume segments")
        pairs = []
        for seg in self.history:
            if not isinstance(seg, (list, tuple)) or len(seg) not in (2, 4):
                raise ValueError(
                    f"Hello.history entries must be (world size, batches[, stride, extra]), got {seg!r:.60}"
                )
            _check_int("Hello", "history world size", seg[0], 1)
            if seg[0] > MAX_HISTORY_WORLD:
                raise ValueError(f"Hello.history world size must be <= {MAX_HISTORY_WORLD}, got {seg[0]}")
            _check_int("Hello", "history batches", seg[1])
            if len(seg) == 4:
                _check_int("Hello", "history stride", seg[2], 1)
                _check_int("Hello", "history extra", seg[3])
                if seg[3] >= seg[2] or seg[2] > seg[0]:
                    raise ValueError(f"Hello.history segment {tuple(seg)} needs extra < stride <= world size")
            pairs.append(tuple(seg))
        object.__setattr__(self, "history", tuple(pairs))
        _check_int("Hello", "world_size", self.world_size, 1)
        _check_int("Hello", "rank", self.rank)
        if self.rank >= self.world_size:
            raise ValueError(f"Hello.rank {self.rank} must be < world_size {self.world_size}")
        _check_str("Hello", "split", self.split)
        if self.sources is not None:
            _check_names("Hello", "sources", self.sources)
        for name in ("stream", "epoch", "cursor", "credit"):
            _check_int("Hello", name, getattr(self, name))
            # Far below what msgpack can carry, so the server can always count on from here
            # (credit needs no cap: the server never has more than its hwm in flight).
            if name != "credit" and getattr(self, name) > 2**48:
                raise ValueError(f"Hello.{name} {getattr(self, name)} is beyond 2**48")
        _check_interval("Hello", "heartbeat", self.heartbeat)


@dataclass(frozen=True)
class Welcome:
    """Server → client: the stream is accepted; what it will carry.

    Attributes:
        session: the server's name for this session (appears in its logs).
        stream: echoes Hello.stream.
        sources: the sources each batch carries, in order.
        schema: per source, ``{"dtype": str | None, "shape": list | None}``: the dtype and the
            per-example shape (without the batch axis), None where the server cannot know it
            before the first batch (a generic Fuel stream).
        batches_per_epoch: batches this client gets per epoch, None if the server cannot tell.
        heartbeat: the server's heartbeat interval in seconds.
        info: plain facts about the dataset (rows, splits, seed, batch size...).
        local: how a client on the server's own host may reach it faster, or None:
            ``{"endpoint": "ipc:///…/server.sock", "token": "…"}``. The server wrote ``token``
            into ``<socket path>.token``; a client that reads the same token there shares the
            server's filesystem, so the ipc endpoint reaches the same server.
        fingerprint: the sequence fingerprint of the split, or None from a source that cannot
            tell: named parts (``"seed": "0"``, ``"files": "4 files #…"``...) of everything that
            decides which batch a position means. A client holds a stream to the first one it
            sees and refuses a server (restarted, or another of the same reader) whose
            fingerprint differs. Optional on the wire: peers that predate it ignore the key.
    """

    TYPE: ClassVar[str] = "welcome"
    session: str
    stream: int
    sources: tuple[str, ...]
    schema: Mapping[str, Any]
    batches_per_epoch: int | None
    heartbeat: float
    info: Mapping[str, Any] = field(default_factory=dict)
    local: Mapping[str, str] | None = None
    fingerprint: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        _check_str("Welcome", "session", self.session)
        if self.fingerprint is not None:
            object.__setattr__(self, "fingerprint", _checked_fingerprint(self.fingerprint))
        if self.local is not None:
            if not isinstance(self.local, Mapping) or set(self.local) != {"endpoint", "token"}:
                raise ValueError("Welcome.local must be a map of endpoint and token")
            _check_str("Welcome", "local endpoint", self.local["endpoint"])
            _check_str("Welcome", "local token", self.local["token"])
            if not self.local["endpoint"].startswith("ipc://") or len(self.local["endpoint"]) > 4096:
                raise ValueError(f"Welcome.local endpoint must be an ipc:// path, got {self.local['endpoint']!r:.60}")
        _check_int("Welcome", "stream", self.stream)
        _check_names("Welcome", "sources", self.sources)
        if not isinstance(self.schema, Mapping) or set(self.schema) != set(self.sources):
            raise ValueError("Welcome.schema must map exactly the served sources")
        if self.batches_per_epoch is not None:
            _check_int("Welcome", "batches_per_epoch", self.batches_per_epoch)
        _check_interval("Welcome", "heartbeat", self.heartbeat)
        if not isinstance(self.info, Mapping):
            raise ValueError("Welcome.info must be a map")


@dataclass(frozen=True)
class Credit:
    """Client → server: the client has room for ``n`` more batches, and ``released`` names the
    shared-memory regions (``fuelline.protocol.placement``) of batches it no longer holds. One
    of the two is not empty."""

    TYPE: ClassVar[str] = "credit"
    n: int
    released: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_int("Credit", "n", self.n, 0 if self.released else 1)
        if not isinstance(self.released, (list, tuple)) or len(self.released) > MAX_RELEASED:
            raise ValueError(f"Credit.released must be a list of at most {MAX_RELEASED} region ids")
        for region in self.released:
            if type(region) is not int or not 0 <= region < 2**62:
                raise ValueError(f"Credit.released holds {region!r:.40}, not a region id")
        object.__setattr__(self, "released", tuple(self.released))


@dataclass(frozen=True, eq=False)
class Batch:
    """Server → client: batch ``seq`` of ``epoch`` on stream ``stream``.

    ``arrays`` maps source name to array in the order of Welcome.sources. ``checksum`` names
    the algorithm the per-array checksums were made with, or is None when there are none.
    """

    TYPE: ClassVar[str] = "batch"
    stream: int
    epoch: int
    seq: int
    arrays: Mapping[str, np.ndarray]
    checksum: str | None = "xxh3_64"

    def __post_init__(self) -> None:
        for name in ("stream", "epoch", "seq"):
            _check_int("Batch", name, getattr(self, name))
        if not isinstance(self.arrays, Mapping):
            raise ValueError("Batch.arrays must be a mapping of source name to array")


@dataclass(frozen=True)
class EndOfEpoch:
    """Server → client: ``epoch`` is complete after ``batches`` batches."""

    TYPE: ClassVar[str] = "end_of_epoch"
    stream: int
    epoch: int
    batches: int

    def __post_init__(self) -> None:
        for name in ("stream", "epoch", "batches"):
            _check_int("EndOfEpoch", name, getattr(self, name))


@dataclass(frozen=True)
class Heartbeat:
    """Either way: I am alive (sent only by a side that has been idle for an interval).

    A server's heartbeat also says how far it got: ``sent`` batches and ends of epoch on stream
    ``stream`` so far. Messages of one connection arrive in order, so a client that has received
    fewer of that stream lost some in transit (a connection reset, which libzmq reconnects
    silently) and asks again from its position, instead of waiting for batches that never come.
    A client's heartbeat says how much credit it granted (``sent``: batches, all told, in its
    Hello of stream ``stream`` and the Credits after it): a server that received less lost some
    Credits in transit the same way, and makes good the difference, instead of waiting for credit
    that never comes while the client waits for batches. Both are None from servers that do not
    count and from clients that do not say.
    """

    TYPE: ClassVar[str] = "heartbeat"
    stream: int | None = None
    sent: int | None = None

    def __post_init__(self) -> None:
        if (self.stream is None) != (self.sent is None):
            raise ValueError("Heartbeat.stream and Heartbeat.sent come together")
        if self.stream is not None:
            _check_int("Heartbeat", "stream", self.stream)
            _check_int("Heartbeat", "sent", self.sent)


@dataclass(frozen=True)
class Error:
    """Server → client: a request was refused. Its layout never changes between versions, so
    a peer of any version can read why it was turned away."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    fatal: bool = True

    def __post_init__(self) -> None:
        _check_str("Error", "code", self.code)
        _check_str("Error", "message", self.message, allow_empty=True)
        if type(self.fatal) is not bool:
            raise ValueError("Error.fatal must be a bool")


@dataclass(frozen=True)
class Bye:
    """Either way: I am leaving (the server on shutdown, the client on close)."""

    TYPE: ClassVar[str] = "bye"
    reason: str = ""

    def __post_init__(self) -> None:
        _check_str("Bye", "reason", self.reason, allow_empty=True)


Message = Union[Hello, Welcome, Credit, Batch, EndOfEpoch, Heartbeat, Error, Bye]
MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Credit, Batch, EndOfEpoch, Heartbeat, Error, Bye)
}
