"""``ServerDataStream``: a Fuel-compatible stream that reads its batches from a data server."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Iterator, Mapping, Sequence

import zmq

from fuelline.client.connection import Connection, Item
from fuelline.client.curve import CurveKeys
from fuelline.protocol import DEFAULT_LIMITS, Hello, Limits, ReceiveTimeout

__all__ = ["ServerDataStream"]

STATE_FORMAT = 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


class ServerDataStream:
    """Reads batches from a fuelline data server, as Fuel's ``ServerDataStream`` did.

    Each call of ``get_epoch_iterator()`` is the next epoch (or, after ``load_state_dict``, the
    rest of the saved one). Batches are tuples in ``sources`` order, or dicts with
    ``as_dict=True``; numpy arrays rebuilt on the received frames without a copy, or torch tensors
    on the same memory with ``tensors=True``.

    Args:
        sources: the sources wanted, in order; None for every source the server has.
        host, port: the data server.
        hwm: batches held at most (in flight plus received and not yet taken): the prefetch depth.
        rank, world_size: this reader's share of each epoch; default torchrun's RANK / WORLD_SIZE,
            else 0 / 1.
        split: which split of the dataset to read ("train", "val"...).
        endpoints: ``["host:port"]``, in place of host and port.
        timeout: seconds to keep trying to reach a silent or absent server before raising
            ``ServerUnavailable``.
        heartbeat: seconds of idleness after which this client tells the server it is alive.
        receive_timeout: if set, raise ``ReceiveTimeout`` when a live server delivers no batch for
            this many seconds (a stuck source); None waits as long as the server is alive.
        tensors: yield torch tensors (zero-copy) instead of numpy arrays.
        verify: check every array against its checksum.
        client_id: a stable name for this client in the server's logs; random by default.
        curve_keys: for a server that uses CURVE (``fuelline serve --curve-keys``): a directory
            holding this client's ``client.key_secret`` and the server's ``server.key``, or a
            ``fuelline.client.curve.CurveKeys``. None connects without encryption.

    Raises:
        ServerUnavailable: no answer from the server within ``timeout``.
        RemoteError: the server refused the request (unknown source or split, version, data
            error), or refused this client's CURVE key (code ``curve-refused``) or its lack of
            one (``curve-mismatch``).
        DataError: a CURVE key file is missing or unreadable (the message names it).
    """

    def __init__(
        self,
        sources: Sequence[str] | None = None,
        host: str = "localhost",
        port: int = 5557,
        hwm: int = 10,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        split: str = "train",
        endpoints: Sequence[str] | None = None,
        timeout: float = 60.0,
        heartbeat: float = 1.0,
        receive_timeout: float | None = None,
        tensors: bool = False,
        verify: bool = True,
        client_id: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        curve_keys: str | os.PathLike[str] | CurveKeys | None = None,
    ) -> None:
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1, got {hwm}")
        if timeout <= 0 or heartbeat <= 0:
            raise ValueError("timeout and heartbeat must be positive seconds")
        self.rank = _env_int("RANK", 0) if rank is None else int(rank)
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if endpoints is not None:
            if isinstance(endpoints, str):
                endpoints = [e for e in endpoints.split(",") if e]
            if len(endpoints) != 1:
                raise NotImplementedError(
                    f"reading from {len(endpoints)} servers at once is not supported yet; give one endpoint"
                )
            host, _, port_s = endpoints[0].rpartition(":")
            if not host or not port_s.isdigit():
                raise ValueError(f"endpoint {endpoints[0]!r} is not HOST:PORT")
            port = int(port_s)
        host = host.strip("[]")
        self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.split = split
        self.hwm = hwm
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.receive_timeout = receive_timeout
        self.tensors = tensors
        self._requested = tuple(sources) if sources is not None else None
        self._hello = Hello(
            client_id=client_id or uuid.uuid4().hex,
            rank=self.rank,
            world_size=self.world_size,
            split=split,
            sources=self._requested,
            heartbeat=heartbeat,
        )
        self._verify = verify
        self._limits = limits
        self._context = context
        # Loaded now, so a missing key file fails here rather than at the first batch.
        self._curve = curve_keys if isinstance(curve_keys, CurveKeys) or curve_keys is None else CurveKeys.from_dir(curve_keys)
        self._conn: Connection | None = None
        self._stream = 0  # the stream the connection is reading; changes on every seek
        self._pos: tuple = (0, 0, ())  # (epoch, batch, history) of the next item the connection hands over
        self._history: tuple = ()  # segments of self._epoch run at other world sizes (resume)
        self._epoch = 0  # next epoch to start, or the one in progress
        self._cursor = 0  # batches of self._epoch delivered
        self._active: object | None = None  # token of an epoch iterator that delivered batches
        self._current: object | None = None  # token of the newest epoch iterator
        self._closed = False
        if tensors:
            import torch  # noqa: F401  (fail now, not at the first batch, if it is missing)

    # -- Fuel's interface ----------------------------------------------------------------------
    @property
    def sources(self) -> tuple[str, ...]:
        """The source names, in the order of every batch tuple."""
        if self._requested is not None:
            return self._requested
        return self._welcome().sources

    @property
    def schema(self) -> Mapping[str, Any]:
        """Per source ``{"dtype", "shape"}`` as the server announced it."""
        return self._welcome().schema

    @property
    def info(self) -> Mapping[str, Any]:
        """What the server says about the dataset split (rows, batch size, seed...)."""
        return self._welcome().info

    @property
    def data_losses(self) -> list[str]:
        """What the server could not read and left out (``--on-bad-shard skip``), in its words."""
        return list(self._conn.data_losses) if self._conn is not None else []

    @property
    def batches_per_epoch(self) -> int | None:
        return self._welcome().batches_per_epoch

    def get_epoch_iterator(self, as_dict: bool = False) -> Iterator[Any]:
        """The next epoch's batches (the rest of an interrupted epoch after ``load_state_dict``)."""
        if self._closed:
            raise RuntimeError("ServerDataStream is closed")
        if self._active is not None:
            # The previous epoch was left part-way: Fuel moves on to the next epoch.
            self._epoch, self._cursor, self._history, self._active = self._epoch + 1, 0, (), None
        self._position_at(self._epoch, self._cursor)
        token = self._current = object()
        return self._iterate(token, as_dict)

    def __iter__(self) -> Iterator[Any]:
        return self.get_epoch_iterator()

    def next_epoch(self, as_dict: bool = False) -> Iterator[Any]:
        return self.get_epoch_iterator(as_dict)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: the next batch this reader has not yet handed out."""
        return {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "rank": self.rank,
            "world_size": self.world_size,
            "split": self.split,
            "history": [list(h) for h in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next epoch iterator resumes at its position.

        The state may come from another world size (a job of 4 ranks resumed on 2): ranks read
        in lockstep, so every rank's state holds the same position, and the rest of the
        interrupted epoch is shared out afresh among the new ranks, none lost or repeated. The
        server must serve a unit-based source (Parquet or converted multimodal data) for that.
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"state format {state.get('format')!r} is not {STATE_FORMAT}")
        if state["split"] != self.split:
            raise ValueError(f"state was saved with split={state['split']!r}, this stream has {self.split!r}")
        epoch, cursor = state["epoch"], state["cursor"]
        if type(epoch) is not int or type(cursor) is not int or epoch < 0 or cursor < 0:
            raise ValueError(f"state has an invalid position epoch={epoch!r} cursor={cursor!r}")
        history = tuple((int(w), int(c)) for w, c in state.get("history", ()))
        if state["world_size"] != self.world_size:
            history, cursor = history + ((int(state["world_size"]), cursor),), 0
        elif state["rank"] != self.rank:
            raise ValueError(f"state was saved by rank {state['rank']}, this stream is rank {self.rank}")
        self._epoch, self._cursor, self._history, self._active = epoch, cursor, history, None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell the server goodbye and free the socket and thread."""
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "ServerDataStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = Connection(
                self.endpoint,
                self._hello,
                hwm=self.hwm,
                heartbeat=self.heartbeat,
                timeout=self.timeout,
                verify=self._verify,
                limits=self._limits,
                context=self._context,
                curve=self._curve,
            )
            self._conn.start(self._stream, self._epoch, self._cursor, self._history)
            self._pos = (self._epoch, self._cursor, self._history)
        return self._conn

    def _position_at(self, epoch: int, cursor: int) -> None:
        conn = self._connection()
        # The same batch numbers mean other batches under another history: compare both.
        if self._pos != (epoch, cursor, self._history):
            self._stream += 1
            conn.seek(self._stream, epoch, cursor, self._history)
            self._pos = (epoch, cursor, self._history)

    def _welcome(self) -> Any:
        return self._connection().wait_welcome(self.timeout)

    def _take(self) -> Item:
        conn = self._connection()
        started = time.monotonic()
        while True:
            item = conn.take(0.25)
            if item is None:
                if self.receive_timeout is not None and time.monotonic() - started > self.receive_timeout:
                    raise ReceiveTimeout(f"no batch from {self.endpoint} in {self.receive_timeout:.1f}s")
                continue
            if item.stream == self._stream:
                return item
            # An item of a stream left behind by a seek: drop it.

    def _convert(self, arrays: dict, as_dict: bool) -> Any:
        if self.tensors:
            import torch

            arrays = {k: torch.from_numpy(v) for k, v in arrays.items()}
        # The server sends a batch's arrays in the order of this client's sources (its Welcome).
        return dict(arrays) if as_dict else tuple(arrays.values())

    def _iterate(self, token: object, as_dict: bool) -> Iterator[Any]:
        while self._current is token:  # an iterator replaced by a newer one stops
            item = self._take()
            conn = self._conn
            assert conn is not None
            if item.kind == "end":
                self._epoch, self._cursor, self._history = item.epoch + 1, 0, ()
                self._pos = (self._epoch, 0, ())
                if self._active is token:
                    self._active = None
                return
            self._pos = (item.epoch, item.seq + 1, self._history)
            self._epoch, self._cursor = item.epoch, item.seq + 1
            self._active = token
            conn.credit(item.stream)
            yield self._convert(item.arrays, as_dict)
