"""Both ends of the Fuel-stream benchmark, runnable by any interpreter: this tree's, another
revision's (on PYTHONPATH), or Fuel 0.2's own virtual environment, which has no fuelline.

    python fuel_stream_ends.py serve fuelline|fuel BATCHES [--fresh]
    python fuel_stream_ends.py read fuelline|fuel PORT BATCHES [--tcp]

The stream is the one a user measures first: the same 3 MB array object (256 × 3000 float32)
yielded for every batch. ``serve`` prints ``serving on tcp://127.0.0.1:PORT`` once it listens;
``read`` reads BATCHES batches and prints one JSON line: batches, bytes, seconds (from the first
batch's arrival to the last's) and its own CPU seconds over that span.

Fuel 0.2's server is ``fuel.server.start_server``'s loop with Fuel's own ``send_arrays``, on a
socket bound to 127.0.0.1 (``start_server`` binds every interface, and takes no host).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterator

import numpy as np

SHAPE = (256, 3000)
HWM = 10
HOST = "127.0.0.1"
TIMEOUT_S = 60.0


class RepeatedArray:
    """A Fuel-style stream: the same array, ``batches`` times an epoch."""

    sources = ("features",)

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.array = np.random.default_rng(0).random(SHAPE, dtype=np.float32)

    def get_epoch_iterator(self, **kwargs: Any) -> Iterator[tuple[np.ndarray]]:
        return ((self.array,) for _ in range(self.batches))


def serve_fuel(batches: int) -> None:
    import logging

    import zmq
    from fuel.server import logger, send_arrays

    logging.basicConfig(level="INFO")  # (as fuel.server.start_server does: a line per batch)
    stream = RepeatedArray(batches)
    socket = zmq.Context().socket(zmq.PUSH)
    socket.set_hwm(HWM)
    port = socket.bind_to_random_port(f"tcp://{HOST}")
    print(f"serving on tcp://{HOST}:{port}", flush=True)
    it = stream.get_epoch_iterator()
    logger.info("server started")
    while True:
        try:
            data = next(it)
            stop = False
            logger.info("sending {} arrays".format(len(data)))
        except StopIteration:
            it = stream.get_epoch_iterator()
            data = None
            stop = True
            logger.info("sending StopIteration")
        send_arrays(socket, data, stop=stop)


def serve_fuelline(batches: int, fresh: bool) -> None:
    from fuelline.server import start_server

    start_server(RepeatedArray(batches), port=0, hwm=HWM, host=HOST, **({"fresh_arrays": True} if fresh else {}))


def _timed(batches: Iterator[tuple[np.ndarray, ...]], n: int) -> dict[str, Any]:
    got = nbytes = 0
    start = cpu = 0.0
    for batch in batches:
        got += 1
        if got == 1:
            start, cpu = time.perf_counter(), time.process_time()
        else:
            nbytes += sum(a.nbytes for a in batch)
            float(batch[0].flat[0])  # (touch it)
        if got == n:
            break
    return {"batches": got, "bytes": nbytes, "seconds": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu}


def read_fuel(port: int, n: int) -> dict[str, Any]:
    from fuel.streams import ServerDataStream

    stream = ServerDataStream(("features",), False, host=HOST, port=port, hwm=HWM)
    stream.socket.setsockopt(__import__("zmq").RCVTIMEO, int(TIMEOUT_S * 1000))
    return _timed(stream.get_epoch_iterator(), n)


def read_fuelline(port: int, n: int, tcp: bool) -> dict[str, Any]:
    from fuelline.client import ServerDataStream

    with ServerDataStream(("features",), host=HOST, port=port, hwm=HWM, timeout=TIMEOUT_S, receive_timeout=TIMEOUT_S,
                          **({"local": False} if tcp else {})) as stream:
        out = _timed(stream.get_epoch_iterator(), n)
        out["transport"] = stream.transports[0]
    return out


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "serve":
        if argv[1] == "fuel":
            serve_fuel(int(argv[2]))
        else:
            serve_fuelline(int(argv[2]), "--fresh" in argv)
        return 0
    if len(argv) >= 4 and argv[0] == "read":
        port, n = int(argv[2]), int(argv[3])
        out = read_fuel(port, n) if argv[1] == "fuel" else read_fuelline(port, n, "--tcp" in argv)
        out["pid"] = os.getpid()
        print(json.dumps(out), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
