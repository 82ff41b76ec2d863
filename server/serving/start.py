"""``start_server``: Fuel's entry point, with fuelline's server behind it."""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from typing import Any

from fuelline.protocol.common.endpoints import ready_line
from fuelline.server.serving.admission import DEFAULT_MAX_CLIENTS
from fuelline.server.serving.keys import CurveConfig
from fuelline.server.serving.server import Server
from fuelline.server.sources.contract import BatchSource
from fuelline.server.sources.fuel import DEFAULT_BUFFER_MB, FuelStreamSource

__all__ = ["start_server", "serve_until_signalled", "STOP_DEADLINE"]

# Seconds from SIGTERM (or SIGINT) by which a server's process is gone: the loop says Bye and
# stops in about 2 s (producers joined, queued Byes lingered), a stage still running is abandoned
# and named; past this, whatever still holds the process (a decode stuck in a storage read that
# never returns, on a thread the interpreter waits for at exit) ends with it, every thread's
# traceback printed to stderr, exit status 1. (Only code that never lets go of the interpreter
# lock escapes this: no Python code, the signal handler included, runs again.)
STOP_DEADLINE = 8.0


def serve_until_signalled(server: Server, announce: bool = True, *, exiting: bool = False) -> None:
    """Serve in this thread until SIGTERM or SIGINT, then tell every client and return.

    Args:
        exiting: the caller ends the process once this returns (``fuelline serve``): the process
            is then gone within ``STOP_DEADLINE`` of the signal, whatever still runs in it.
            Otherwise the deadline holds only until this returns.
    """
    main = threading.current_thread() is threading.main_thread()
    if main:
        armed: list[int] = []

        def on_signal(signum: int, frame: Any) -> None:
            if not armed:
                armed.append(signum)
                # (A C-level timer: it fires even where no Python code runs again.)
                faulthandler.dump_traceback_later(STOP_DEADLINE, exit=True)
            server.stop(f"server shutting down ({signal.Signals(signum).name})")

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def ready(endpoint: str) -> None:
        if announce:
            print(ready_line(endpoint), flush=True)

    try:
        server.serve_forever(ready=ready)
    finally:
        if main and not exiting:
            faulthandler.cancel_dump_traceback_later()


def start_server(
    data_stream: Any,
    port: int = 5557,
    hwm: int = 10,
    host: str = "127.0.0.1",
    *,
    heartbeat: float = 1.0,
    checksum: bool = True,
    curve_keys: str | None = None,
    memory_cache: int = 10,
    insecure: bool = False,
    max_clients: int = DEFAULT_MAX_CLIENTS,
    buffer_mb: int = DEFAULT_BUFFER_MB,
    fresh_arrays: bool = False,
) -> None:
    """Serve a data stream to ``ServerDataStream`` clients until SIGTERM/SIGINT, as Fuel did.

    The server copies each batch of a Fuel-style stream once, as it reads it (and checksums it
    in the same pass over memory), and from then on holds and sends only that copy: a stream may
    refill the same preallocated arrays for every batch, as many Fuel and numpy streams do, and
    every client still gets each batch as it was yielded. A client on the server's host gets that
    copy in the shared memory it maps, not copied again. ``fresh_arrays=True`` skips the copy.

    Args:
        data_stream: a Fuel-style stream (``.sources``, ``.get_epoch_iterator()`` yielding tuples
            of arrays in ``sources`` order), a mapping of split name to such streams, or a
            ``BatchSource`` such as ``fuelline.server.ParquetSource``.
        port: TCP port; 0 picks a free one (the ``serving on`` line tells which).
        hwm: most batches in flight to one client.
        host: interface to bind; loopback by default.
        heartbeat: seconds of silence after which the server sends a heartbeat.
        checksum: checksum every array (xxh3).
        curve_keys: a directory made with ``fuelline keygen`` (``server.key_secret``, and
            ``authorized/`` with the public key of every client to accept): encrypt and
            authenticate with CURVE. None serves in the clear, which off loopback needs ``insecure``.
        memory_cache: the last K batches sent to each client are kept, so a client that
            reconnects gets them again without the stream being run again. They are kept by
            reference with the checksums they were sent with: a batch whose arrays changed since
            (a stream that reuses its buffers) is prepared again instead. 0 keeps none.
        insecure: allow a ``host`` other than loopback without ``curve_keys`` (refused otherwise:
            anyone who reaches the port would read the data).
        max_clients: most client sessions at once; a Hello beyond is refused as busy
            (``fuelline.server.serving.admission``).
        buffer_mb: a Fuel stream is read once per epoch and its batches shared by every rank
            and reconnect, kept within this many MB (``fuelline.server.sources.fuel``); a rank that
            falls further behind reads the stream again on its own, which a stream that shuffles
            differently on every call refuses with an error naming this option.
        fresh_arrays: promise that the stream yields new arrays for every batch and that nothing
            writes to them afterwards; they are then served from their own memory, without the
            copy. A stream that breaks it may be served bytes it wrote later (caught by the
            checksums, unless ``checksum=False``). Only for Fuel-style streams: a ``BatchSource``
            owns its batches, and passing True with one is a ValueError.
    """
    if isinstance(data_stream, BatchSource):
        if fresh_arrays:
            raise ValueError(f"fresh_arrays applies to Fuel-style streams; {type(data_stream).__name__} is a BatchSource")
        source = data_stream
    else:
        source = FuelStreamSource(data_stream, buffer_mb, fresh_arrays=fresh_arrays)
    curve = CurveConfig.from_dir(curve_keys) if curve_keys is not None else None
    server = Server(source, host=host, port=port, hwm=hwm, heartbeat=heartbeat, checksum=checksum, curve=curve,
                    memory_cache=memory_cache, insecure=insecure, max_clients=max_clients)
    server.bind()
    try:
        serve_until_signalled(server)
    finally:
        sys.stdout.flush()
