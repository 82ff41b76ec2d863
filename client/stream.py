"""``ServerDataStream``: a Fuel-compatible stream that reads its batches from a data server."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Iterator, Mapping, Sequence

import zmq

from fuelline.client.agreement import check_agreement, idle_processes, left_out_at_start
from fuelline.client.checkpoint import (
    STATE_FORMAT as STATE_FORMAT,  # (re-exported: it was defined here)
    position_state,
    resume_from,
    stream_from_state,
)
from fuelline.client.connection import FILES_PER_CONNECTION, FILES_PER_CONTEXT, Connection, Item
from fuelline.client.curve import CurveKeys
from fuelline.client.device import device_placement
from fuelline.client.signature import stream_arguments
from fuelline.client.turns import take_in_turn
from fuelline.protocol import DEFAULT_LIMITS, Hello, Limits
from fuelline.protocol.common import descriptors
from fuelline.protocol.common.endpoints import tcp_endpoint
from fuelline.protocol.common.ports import check_port

__all__ = ["ServerDataStream"]

log = logging.getLogger("fuelline.client")

# Servers (as a tuple of endpoints) whose readers were already told they have fewer connections
# than serving processes: once a process (a trainer's train, val and label streams read the same).
_TOLD: set[tuple[str, ...]] = set()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The reader's rank and world size: as given, else torchrun's ``RANK`` and ``WORLD_SIZE``."""
    r = _env_int("RANK", 0) if rank is None else int(rank)
    w = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is outside world size {w}")
    return r, w


def _servers(host: str, port: int, endpoints: Sequence[str] | str | None) -> tuple[str, ...]:
    """The servers' ``tcp://`` endpoints: ``endpoints`` (a list, or one comma-separated string),
    else ``host`` and ``port``; each once."""
    if endpoints is None:
        port = check_port(port, "port")
        endpoints = [f"[{host}]:{port}" if ":" in host.strip("[]") else f"{host}:{port}"]
    elif isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",") if e]
    if not endpoints:
        raise ValueError("endpoints must name at least one HOST:PORT")
    servers = tuple(tcp_endpoint(e, "endpoints") for e in endpoints)
    if len(set(servers)) != len(servers):
        raise ValueError(f"endpoints {list(endpoints)} name a server twice")
    return servers


def _per_server(connections: Any) -> int:
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ValueError(f"connections must be a whole number >= 1, got {connections!r}")
    return connections


def _curve_keys(keys: str | os.PathLike[str] | CurveKeys | None) -> CurveKeys | None:
    return keys if isinstance(keys, CurveKeys) or keys is None else CurveKeys.from_dir(keys)


class ServerDataStream:
    """Reads batches from a fuelline data server, as Fuel's ``ServerDataStream`` did.

    Each call of ``get_epoch_iterator()`` is the next epoch (or, after ``load_state_dict``, the
    rest of the saved one). Batches are tuples in ``sources`` order, or dicts with
    ``as_dict=True``; numpy arrays rebuilt on the received frames without a copy, or torch tensors
    on the same memory with ``tensors=True``.

    Positional arguments after ``sources`` are ``(host, port, hwm)``, or Fuel 0.2's
    ``(produces_examples, host, port, hwm, axis_labels)`` when the first is a bool. A stream
    pickles without its connections: the copy connects on first use, at the original's position.

    Batches that come through a socket (over TCP, or ``shared_memory=False``) live in buffers
    libzmq allocates: on glibc, a stream raises its process's malloc trim threshold to twice what
    its connections may hold in flight (64 MB to 1 GiB) and fixes the mmap threshold at 32 MB, so
    that freed buffers serve the next batches instead of being faulted in again
    (``fuelline.client.heap``). ``FUELLINE_HEAP=system``, or glibc's own ``MALLOC_*`` settings
    in the environment, leave the heap as it is.

    Args:
        sources: the sources wanted, in order; None for every source the server has.
        host: the data server's host name or address.
        port: the data server's port.
        hwm: batches held at most (in flight plus received and not yet taken): the prefetch depth.
        produces_examples: Fuel's flag; only False (batches) can be honoured, True raises ValueError.
        axis_labels: Fuel's axis labels, kept as ``.axis_labels``.
        rank: which share of each epoch this reader reads, of ``world_size``; None: torchrun's
            ``RANK``, else 0.
        world_size: how many shares each epoch is dealt into; None: torchrun's ``WORLD_SIZE``,
            else 1.
        split: which split of the dataset to read ("train", "val"...).
        endpoints: ``["hostA:5557", "hostB:5557"]`` (or one comma-separated string), in place of
            host and port: read from several servers at once. Started with the same dataset and
            options, each serves a disjoint part of this reader's share; batch k of an epoch
            comes from server k mod E, so the order is deterministic, and each server's connection
            reconnects and resumes on its own. ``hwm`` is shared among them.
        connections: connections to each server, each a session of its own that serves a
            disjoint part of this reader's share, as another server would. For a server of
            several serving processes (``fuelline serve --processes N``), N: each process then
            prepares part of this reader's batches (a reader on the server's host is dealt to the
            processes in turn; one on another host lands where the kernel's hash puts each
            connection). A server of one process gains nothing from more than one. As between
            ranks, every connection gets the same number of batches: an epoch that does not
            divide among them is padded by wrapping, as it would be among N servers.
        timeout: seconds to keep trying to reach a silent or absent server before raising
            ``ServerUnavailable``.
        connect_timeout: seconds to keep trying a server that refuses the connection (nothing
            listens at the port) before its first Welcome; once welcomed, a server that goes away
            (a restart) gets the whole ``timeout``.
        heartbeat: seconds of idleness after which this client tells the server it is alive.
        receive_timeout: if set, raise ``ReceiveTimeout`` when a live server delivers no batch for
            this many seconds (a stuck source); None waits as long as the server is alive.
        tensors: yield torch tensors (zero-copy) instead of numpy arrays.
        device: yield torch tensors on this device (``"cuda"``, ``"cpu"``...), copied with
            ``pin_memory`` through pinned host memory on a side CUDA stream while the caller
            trains on the batch before: see ``fuelline.client.device``. ValueError where this
            host has no such device.
        pin_memory: place batches in pinned host memory on their way (without ``device``, or
            with ``"cpu"``: pinned CPU tensors, for the caller's own non-blocking copy).
            ValueError where torch cannot pin memory.
        verify: check every array against its checksum.
        client_id: a stable name for this client in the server's logs; random by default.
        curve_keys: for a server that uses CURVE (``fuelline serve --curve-keys``): a directory
            holding this client's ``client.key_secret`` and the server's ``server.key``, or a
            ``fuelline.client.curve.CurveKeys``. None connects without encryption.
        local: on the server's own host, read through the Unix socket it offers instead of TCP
            (several times faster for large batches); False keeps TCP.
        shared_memory: on that Unix socket, have the server place batches in shared memory: the
            arrays are built on pages both processes map, with no copy through the socket and no
            checksum (nothing crosses a wire). The server reuses a batch's memory only once every
            array of it (and anything made from one without a copy) is garbage. False: the socket.

    Raises:
        ServerUnavailable: no answer from the server within ``timeout``.
        RemoteError: the server refused the request (unknown source or split, version, data
            error), or refused this client's CURVE key (code ``curve-refused``) or its lack of
            one (``curve-mismatch``).
        FingerprintMismatch: a server (restarted, another of this reader's, or the one a saved
            position is resumed on) serves another sequence than the batches read so far: other
            files, seed, batch size, windows... (the message names the part). Raised before any
            batch of that server is handed out.
        DataError: a CURVE key file is missing or unreadable (the message names it).
    """

    def __init__(
        self,
        sources: Sequence[str] | None = None,
        *args: Any,
        host: str = "localhost",
        port: int = 5557,
        hwm: int = 10,
        produces_examples: bool = False,
        axis_labels: Mapping[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        split: str = "train",
        endpoints: Sequence[str] | None = None,
        connections: int = 1,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        heartbeat: float = 1.0,
        receive_timeout: float | None = None,
        tensors: bool = False,
        device: Any = None,
        pin_memory: bool = False,
        verify: bool = True,
        client_id: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        curve_keys: str | os.PathLike[str] | CurveKeys | None = None,
        local: bool = True,
        shared_memory: bool = True,
    ) -> None:
        self._config = stream_arguments(locals(), args)  # (also what rebuilds it: __reduce__)
        host, port, hwm = self._config["host"], self._config["port"], self._config["hwm"]
        self.produces_examples, self.axis_labels = False, self._config["axis_labels"]
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1, got {hwm}")
        if timeout <= 0 or heartbeat <= 0 or connect_timeout <= 0:
            raise ValueError("timeout, connect_timeout and heartbeat must be positive seconds")
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        # One entry per connection: a server read over two connections is read as two servers.
        self.endpoints = tuple(e for e in _servers(host, port, endpoints) for _ in range(_per_server(connections)))
        self.endpoint = self.endpoints[0]
        self.split = split
        self.hwm = hwm
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.heartbeat = heartbeat
        self.receive_timeout = receive_timeout
        self.tensors = tensors
        self._requested = tuple(sources) if sources is not None else None
        # Reading E servers, this reader is E ranks of a world E times as large, one per server:
        # rank r reads ranks r·E … r·E+E-1, the same contiguous span of each epoch a single server
        # would give it, and takes their batches in turn (``fuelline.client.turns``).
        client_id = client_id or uuid.uuid4().hex
        n = len(self.endpoints)
        self._hellos = [
            Hello(
                client_id=client_id if n == 1 else f"{client_id}/{e}",
                rank=self.rank * n + e,
                world_size=self.world_size * n,
                split=split,
                sources=self._requested,
                heartbeat=heartbeat,
            )
            for e in range(n)
        ]
        self._verify = verify
        self._limits = limits
        self._context = context
        # Loaded now, so a missing key file fails here rather than at the first batch.
        self._curve = _curve_keys(curve_keys)
        self._local = local
        self._shared_memory = shared_memory
        self._conns: list[Connection] = []
        self._checked = False  # the servers' welcomes were compared
        self._seek = 0  # the seek counter of the position read now; changes on every seek
        self._pos: tuple = (0, 0, ())  # (epoch, batch, history) of the next item the connection hands over
        self._history: tuple = ()  # segments of self._epoch run at other world sizes (resume)
        self._epoch = 0  # next epoch to start, or the one in progress
        self._cursor = 0  # batches of self._epoch delivered
        self._active: object | None = None  # token of an epoch iterator that delivered batches
        self._current: object | None = None  # token of the newest epoch iterator
        self._closed = False
        self._saved_fingerprint: dict[str, str] | None = None  # of a loaded state, for connections to come
        self.placement = device_placement(device, pin_memory, tensors)  # (checked now, not at the first batch)
        self.device = None if device is None or self.placement is None else self.placement.device
        self.pin_memory = pin_memory

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
        """What the servers could not read and left out (``--on-bad-shard skip``), in their words:
        the shards or recordings left out at start-up, as their Welcomes list them (once, where
        several servers of the dataset list the same), then what each left out since."""
        at_start = [x for conn in self._conns if conn.welcome is not None for x in left_out_at_start(conn.welcome.info)]
        return list(dict.fromkeys(at_start)) + [loss for conn in self._conns for loss in conn.data_losses]

    def data_losses_in(self, epoch: int) -> list[str]:
        """What the servers left out of ``epoch`` while reading it, in their words, each part once
        (a part is told of again when its batches are: a reconnect, the move to a local socket)."""
        return list(dict.fromkeys(
            loss for conn in self._conns for loss, at in zip(conn.data_losses, conn.data_loss_epochs) if at == epoch))

    @property
    def transports(self) -> list[str]:
        """Where each server connection reads from now: its TCP endpoint, or the ipc path of a
        server on this host."""
        return [conn.transport for conn in self._conns]

    @property
    def reconnects(self) -> int:
        """How many times the connections to the servers were re-established."""
        return sum(conn.reconnects for conn in self._conns)

    @property
    def batches_per_epoch(self) -> int | None:
        per_server = self._welcome().batches_per_epoch
        return None if per_server is None else per_server * len(self.endpoints)

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

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: the next batch this reader has not yet handed out, and the sequence
        fingerprint of the batches read (None before any server was heard from)."""
        held = [conn.fingerprint for conn in self._conns if conn.fingerprint is not None]
        return position_state(
            epoch=self._epoch, cursor=self._cursor, rank=self.rank, world_size=self.world_size,
            servers=len(self.endpoints), split=self.split, history=self._history,
            fingerprint=held[0] if held else self._saved_fingerprint,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next epoch iterator resumes at its position.

        The state may come from another world size (a job of 4 ranks resumed on 2) or another
        number of servers: ranks read in lockstep, so every rank's state holds the same position,
        and the rest of the interrupted epoch is shared out afresh among the new ranks, none lost
        or repeated. The servers must serve a unit-based source (Parquet or converted multimodal
        data) for that. A position continues only on servers of the sequence fingerprint it was
        saved with; a state without one (saved by an older client) is taken on trust.

        Raises:
            FingerprintMismatch: a server this stream already reads from serves another sequence.
        """
        at = resume_from(state, split=self.split, rank=self.rank, world_size=self.world_size,
                         servers=len(self.endpoints))
        if at.fingerprint is not None:
            for conn in self._conns:
                conn.hold_to(at.fingerprint, "in the saved position")
            self._saved_fingerprint = at.fingerprint
        self._epoch, self._cursor, self._history, self._active = at.epoch, at.cursor, at.history, None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Tell the servers goodbye and free the sockets, threads and pinned buffers."""
        self._closed = True
        for conn in self._conns:
            conn.close()
        self._conns = []
        if self.placement is not None:
            self.placement.release()

    def __reduce__(self) -> tuple[Any, ...]:
        # The rank and world size as they are now, whatever RANK / WORLD_SIZE say where it is loaded.
        config = {**self._config, "context": None, "rank": self.rank, "world_size": self.world_size}
        return stream_from_state, (type(self), config, self.state_dict())

    def __enter__(self) -> "ServerDataStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _share(self, cursor: int, e: int) -> int:
        """Batches of server ``e`` among the first ``cursor`` this reader takes (in turn)."""
        n = len(self.endpoints)
        return cursor // n + (e < cursor % n)

    def _connections(self) -> list[Connection]:
        if not self._conns:
            n = len(self.endpoints)
            hwm = -(-self.hwm // n)  # the reader's prefetch, shared among its servers
            # (The usual soft limit of 1,024 files would run out at about 120 servers.)
            descriptors.make_room(FILES_PER_CONTEXT + FILES_PER_CONNECTION * n)
            conns: list[Connection] = []
            try:
                for endpoint, hello in zip(self.endpoints, self._hellos):
                    conns.append(Connection(
                        endpoint, hello, hwm=hwm, heartbeat=self.heartbeat, timeout=self.timeout, verify=self._verify,
                        limits=self._limits, context=self._context, curve=self._curve, local=self._local,
                        connect_timeout=self.connect_timeout, shared_memory=self._shared_memory,
                    ))
            except OSError as exc:
                for conn in conns:
                    conn.close()
                if exc.errno not in descriptors.EXHAUSTED:
                    raise
                raise descriptors.exhausted(f"opening connection {len(conns) + 1} of {n} ({endpoint})", exc,
                                            f"a stream takes about {FILES_PER_CONNECTION} a server") from exc
            self._conns = conns
            if self._saved_fingerprint is not None:
                for conn in self._conns:
                    conn.hold_to(self._saved_fingerprint, "in the saved position")
            for e, conn in enumerate(self._conns):
                conn.start(self._seek, self._epoch, self._share(self._cursor, e), self._history)
            self._pos = (self._epoch, self._cursor, self._history)
        return self._conns

    def _position_at(self, epoch: int, cursor: int) -> None:
        conns = self._connections()
        # The same batch numbers mean other batches under another history: compare both.
        if self._pos != (epoch, cursor, self._history):
            self._seek += 1
            for e, conn in enumerate(conns):
                conn.seek(self._seek, epoch, self._share(cursor, e), self._history)
            self._pos = (epoch, cursor, self._history)

    def _welcome(self) -> Any:
        conns = self._connections()
        welcomes = [conn.wait_welcome(self.timeout) for conn in conns]
        if not self._checked:
            check_agreement(self.endpoints, welcomes)
            self._checked = True
            self._hint_connections(welcomes)
        return welcomes[0]

    def _hint_connections(self, welcomes: Sequence[Any]) -> None:
        """Say (once a process, from rank 0) where a server has more serving processes than all the
        ranks' connections to it: some of its processes then prepare none of the job's batches."""
        told = tuple(sorted(set(self.endpoints)))
        if self.rank == 0 and told not in _TOLD:
            hint = idle_processes(self.endpoints, welcomes, self.world_size)
            if hint:
                _TOLD.add(told)
                log.info("%s", hint)

    def _take(self, cursor: int, wait: bool = True) -> tuple[Connection, Item | None]:
        conns = self._connections()
        if len(conns) > 1 and not self._checked:
            self._welcome()
        taken = take_in_turn(conns, cursor, self._seek, self.receive_timeout, wait)
        if not self._checked and conns[0].welcome is not None:  # (one server: nothing to compare)
            self._checked = True
            self._hint_connections([conns[0].welcome])
        return taken

    def _receive(self, cursor: int, wait: bool = True) -> tuple[Item, Any] | None:
        """Item ``cursor`` of the epoch, taken from its server (its credit given back) with its
        arrays, or their placement under way; None if ``wait`` is False and it has not arrived."""
        conn, item = self._take(cursor, wait)
        if item is None:
            return None
        if item.kind == "end":
            self._pos = (item.epoch + 1, 0, ())
            return item, None
        self._pos = (item.epoch, cursor + 1, self._history)
        conn.credit(item.seek)
        assert item.arrays is not None  # (a batch always has them; an end has none)
        placement = self.placement
        return item, item.arrays if placement is None else placement.stage(item.arrays, cursor > self._cursor)

    def _iterate(self, token: object, as_dict: bool) -> Iterator[Any]:
        # With a device, the next item is taken before this one is handed over where it has arrived,
        # so that its copy runs while the caller works; it counts once handed over.
        ahead: tuple[Item, Any] | None = None
        while self._current is token:  # an iterator replaced by a newer one stops
            received = ahead or self._receive(self._cursor)
            assert received is not None  # (waited for)
            item, arrays = received
            if item.kind == "end":
                self._epoch, self._cursor, self._history = item.epoch + 1, 0, ()
                if self._active is token:
                    self._active = None
                return
            ahead = self._receive(self._cursor + 1, wait=False) if self.placement and self.placement.ahead else None
            self._cursor += 1
            self._epoch = item.epoch
            self._active = token
            batch = arrays if self.placement is None else self.placement.hand_over(arrays)
            # The server sends a batch's arrays in the order of this client's sources (its Welcome).
            yield dict(batch) if as_dict else tuple(batch.values())
