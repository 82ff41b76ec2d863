"""``fuelline stream HOST:PORT``: read epochs from data servers and report what arrived and how
fast. The client's command: it imports only the client and the protocol."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from typing import Any, Mapping

from fuelline.client.agreement import SKIPPED
from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.argtypes import positive_int, seconds
from fuelline.protocol.common.endpoints import parse_host_port

__all__ = ["register", "run", "left_out", "servers"]

# How a server words a unit it could not read mid-epoch (fuelline.server.sources.blocks).
ROWS_LEFT_OUT = re.compile(r"its (\d+) rows are left out")


ENDPOINT = "HOST:PORT[,HOST:PORT...]"


def servers(text: str) -> list[str]:
    """The data servers the command line names, each HOST:PORT.

    Raises:
        DataError: one line that names the argument and what to write instead (a port alone, a
            host alone, nothing, or a server named twice).
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise DataError(f"argument {ENDPOINT}: {text!r} names no data server; give HOST:PORT, e.g. localhost:5557")
    for name in names:
        try:
            parse_host_port(name)
        except OptionError as exc:
            host, _, port = name.rpartition(":")
            if name.isdigit():
                fix = f"{name} is a port alone; give the server's host too, e.g. localhost:{name}"
            elif ":" not in name:
                fix = f"{name!r} has no port; give HOST:PORT, e.g. {name}:5557"
            elif not host.strip("[]") and port.isdigit():
                fix = f"{name!r} has no host; give HOST:PORT, e.g. localhost{name}"
            else:
                fix = f"{exc.rule} (e.g. localhost:5557)"
            raise DataError(f"argument {ENDPOINT}: {fix}") from None
    if len(set(names)) != len(names):
        raise DataError(f"argument {ENDPOINT}: {text!r} names a server twice; give each data server once")
    return names


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    stream = sub.add_parser("stream", help="read epochs from a server and report throughput")
    stream.add_argument("endpoint", metavar=ENDPOINT,
                        help="a data server, or several serving the same dataset with the same options")
    stream.add_argument("--epochs", type=positive_int, default=1, help="epochs to read")
    stream.add_argument("--split", default="train", help="which split to read")
    stream.add_argument("--rank", type=int, default=0, help="read this rank's share")
    stream.add_argument("--world-size", type=positive_int, default=1, help="of this many ranks")
    stream.add_argument("--hwm", type=positive_int, default=10, help="batches prefetched")
    stream.add_argument("--connections", type=positive_int, default=1, metavar="N",
                        help="connections to each data server, each a session that serves a disjoint part of the share; "
                             "give a server of --processes N N, so that every one of its processes prepares part of the batches")
    stream.add_argument("--timeout", type=seconds, default=60.0, help="seconds to keep trying a silent server")
    stream.add_argument("--connect-timeout", type=seconds, default=10.0, metavar="SECONDS",
                        help="seconds to keep trying a server that refuses the connection (nothing listens at "
                             "the port) before it first answers; a server that answered once gets --timeout")
    stream.add_argument("--json", action="store_true", help="print one JSON object per epoch")
    stream.add_argument("--curve-keys", default=None, metavar="DIR",
                        help="connect with CURVE: DIR holds client.key_secret and the server's server.key")
    stream.set_defaults(func=run)


def left_out(info: Mapping[str, Any], losses: list[str]) -> dict[str, Any]:
    """What the servers left out of an epoch (``--on-bad-shard skip``): the shards or recordings
    left out at start-up, as the Welcome ``info`` counts and names them, and ``losses``, the
    parts they could not read during the epoch, with the rows those held (all of each part's rows,
    whichever ranks' shares they fell in)."""
    out: dict[str, Any] = {}
    for key in SKIPPED:
        if f"{key}_count" in info:
            out[key] = info[f"{key}_count"]
            out["names"] = [x.get("file", x.get("recording")) for x in info.get(key) or ()]
    out["rows"] = sum(int(m.group(1)) for loss in losses for m in ROWS_LEFT_OUT.finditer(loss))
    out["losses"] = losses
    return out


def _said(report: Mapping[str, Any]) -> str:
    parts = []
    for key, noun in zip(SKIPPED, ("shard", "recording")):
        count = report.get(key, 0)
        if count:
            names = ", ".join(str(n) for n in report["names"]) + (", …" if count > len(report["names"]) else "")
            parts.append(f"{count} {noun}{'s' * (count != 1)} at start-up ({names})")
    if report["losses"]:
        n = len(report["losses"])
        parts.append(f"{report['rows']} rows this epoch ({n} part{'s' * (n != 1)} that could not be read)")
    return "  left out by the servers: " + "; ".join(parts) + " (--on-bad-shard skip)" if parts else ""


class _CtrlC:
    """Ctrl-C, wherever it lands. pyzmq checks for signals when a zero-copy frame is freed, which
    happens whenever a batch's arrays go: a KeyboardInterrupt raised there is printed as ignored
    and lost, and the stream would read on. While reading, such a lost interrupt is noted
    instead, and raised again at the next batch (``check``)."""

    def __init__(self) -> None:
        self.lost = False
        self._previous = sys.unraisablehook, sys.excepthook

    def __enter__(self) -> "_CtrlC":
        # (Cython prints an exception it cannot raise through sys.excepthook, then reports it
        # through sys.unraisablehook)
        sys.unraisablehook, sys.excepthook = self._unraisable, self._printed
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.unraisablehook, sys.excepthook = self._previous

    def _unraisable(self, unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            self._note()
            return
        self._previous[0](unraisable)

    def _printed(self, kind: Any, value: Any, traceback: Any) -> None:
        if isinstance(kind, type) and issubclass(kind, KeyboardInterrupt):
            self._note()
            return
        self._previous[1](kind, value, traceback)

    def check(self) -> None:
        if self.lost:
            raise KeyboardInterrupt

    def _note(self) -> None:
        # A KeyboardInterrupt that pyzmq raised while receiving may also have cost a message,
        # which the connection then asks for again: the command is ending, so say nothing of it.
        self.lost = True
        logging.getLogger("fuelline.client").setLevel(logging.ERROR)


def run(args: argparse.Namespace) -> int:
    with _CtrlC() as ctrl_c:
        return _read(args, ctrl_c)


def _read(args: argparse.Namespace, ctrl_c: _CtrlC) -> int:
    import numpy as np

    from fuelline.client import ServerDataStream

    endpoints = servers(args.endpoint)  # (checked before anything connects)
    try:
        stream = ServerDataStream(
            endpoints=endpoints, connections=args.connections, split=args.split, rank=args.rank,
            world_size=args.world_size, hwm=args.hwm, timeout=args.timeout, connect_timeout=args.connect_timeout,
            curve_keys=args.curve_keys,
        )
    except DataError:
        raise
    except ValueError as exc:  # (an option out of range: --rank beyond --world-size...)
        raise DataError(str(exc)) from None
    with stream:
        info = stream.info  # (every server's Welcome: what they left out at start-up is known before reading)
        for epoch in range(args.epochs):
            number = stream.state_dict()["epoch"]  # the server's number of the epoch read now
            batches = rows = nbytes = 0
            ids: list = []
            start = time.perf_counter()
            for batch in stream.get_epoch_iterator(as_dict=True):
                ctrl_c.check()
                batches += 1
                first = next(iter(batch.values()))
                rows += len(first) if first.ndim else 1
                nbytes += sum(a.nbytes for a in batch.values())
                if "sample_id" in batch:
                    ids.append(batch["sample_id"])
            seconds = time.perf_counter() - start
            ctrl_c.check()
            left = left_out(info, stream.data_losses_in(number))
            report: dict[str, Any] = {
                "epoch": epoch,
                "batches": batches,
                "rows": rows,
                "bytes": nbytes,
                "seconds": round(seconds, 4),
                "rows_per_s": round(rows / seconds, 1) if seconds else None,
                "mb_per_s": round(nbytes / seconds / 1e6, 1) if seconds else None,
                "sources": {k: v for k, v in stream.schema.items()},
                "left_out": left,
            }
            if ids:
                all_ids = np.concatenate(ids)
                report["unique_sample_ids"] = int(len(np.unique(all_ids)))
            if args.json:
                print(json.dumps(report), flush=True)
            else:
                print(
                    f"epoch {epoch}: {batches} batches, {rows} rows, {nbytes / 1e6:.1f} MB in {seconds:.2f}s "
                    f"({report['rows_per_s']} rows/s, {report['mb_per_s']} MB/s)"
                    + (f", {report['unique_sample_ids']} distinct sample_ids" if ids else ""),
                    flush=True,
                )
                said = _said(left)
                if said:
                    print(said, flush=True)
    return 0
