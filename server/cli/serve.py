"""``fuelline serve DATASET``: serve a Parquet or converted multimodal dataset to
``ServerDataStream`` clients until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Mapping

from fuelline.protocol import DataError, OptionError
from fuelline.protocol.common.argtypes import listen_port, non_negative_float, non_negative_int, positive_int, seconds
from fuelline.server.serving.admission import DEFAULT_MAX_CLIENTS
from fuelline.server.sources.options import SourceOptions

if TYPE_CHECKING:  # (the server's modules are imported when it serves, not to parse its options)
    from fuelline.server.serving.server import Server
    from fuelline.server.sources.contract import BatchSource

__all__ = ["register", "run"]

log = logging.getLogger("fuelline.server")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    serve = sub.add_parser("serve", help="serve a Parquet dataset")
    serve.add_argument("dataset", help="directory of Parquet files, or of split folders of them, or a "
                                       "converted dataset; local or a URI (s3://bucket/prefix, file://...)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    serve.add_argument("--port", type=listen_port, default=5557, help="TCP port; 0 picks a free one")
    serve.add_argument("--hwm", type=positive_int, default=10, help="batches in flight per client")
    serve.add_argument("--batch-size", type=positive_int, default=64, help="rows (windows) per batch")
    serve.add_argument("--seed", type=int, default=0, help="seeds every epoch's order, with the epoch number")
    serve.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                       help="shuffle across shards each epoch (off: storage order)")
    serve.add_argument("--shuffle-block", type=positive_int, default=8, help="row groups whose rows are mixed together")
    serve.add_argument("--order-version", type=int, choices=(1, 2), default=2,
                       help="how each block's rows are shuffled: 2 (default) by a generator of the block's own, so "
                            "every rank's first batch waits for its own block only; 1 is the order served before "
                            "this option existed, to resume a run whose position was saved in it")
    serve.add_argument("--heartbeat", type=seconds, default=1.0, help="seconds of silence before a heartbeat")
    serve.add_argument("--checksum", action=argparse.BooleanOptionalAction, default=True, help="xxh3 checksum per array")
    serve.add_argument("--curve-keys", metavar="DIR",
                       help="encrypt with CURVE and accept only the client keys in DIR/authorized/ (fuelline keygen)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a --host other than loopback without --curve-keys (anyone who reaches the port "
                            "reads the data): only for a network that is private by other means")
    serve.add_argument("--status-interval", type=float, default=10.0,
                       help="seconds between status lines in the log (clients, batches/s, MB/s); 0 for none")
    serve.add_argument("--on-bad-shard", choices=["fail", "skip"], default="fail",
                       help="a shard that cannot be read: stop with its name (fail), or leave it out, "
                            "count it and tell the clients (skip)")
    serve.add_argument("--workers", type=non_negative_int, default=0,
                       help="processes that load, align and preprocess in parallel; 0 does it on threads of "
                            "the serving process. The batches are the same for any number")
    serve.add_argument("--processes", type=positive_int, default=1, metavar="N",
                       help="serving processes sharing the port, each a whole server with its own caches and "
                            "workers; the kernel hands each new connection to one of them. One process serves from "
                            "about one core: more serve more clients at once on a host with the cores. The "
                            "batches are the same for any number")
    serve.add_argument("--worker-timeout", type=non_negative_float, default=300.0, metavar="SECONDS",
                       help="a worker process still on one unit after this long is stopped, with where its "
                            "threads were, replaced, and the unit retried once; 0 for no limit")
    serve.add_argument("--memory-cache", type=non_negative_int, default=10, metavar="K",
                       help="the last K batches sent to each client are kept (with those prepared ahead of "
                            "them), so a reconnect resumes without recomputing them; 0 for none")
    serve.add_argument("--decoded-cache-mb", type=non_negative_int, default=1024, metavar="MB",
                       help="decoded row groups / recordings kept in memory for all clients to share: the "
                            "ranks of a job decode each once an epoch, and a data set that fits is decoded "
                            "once; 0 for none")
    serve.add_argument("--local-ipc", action=argparse.BooleanOptionalAction, default=True,
                       help="also listen on a Unix socket that clients on this host move to (faster than "
                            "TCP; not with --curve-keys)")
    serve.add_argument("--shared-memory", action=argparse.BooleanOptionalAction, default=True,
                       help="place the batches of clients on the Unix socket in shared memory (no copy through "
                            "the socket, no checksum)")
    serve.add_argument("--metrics-port", type=listen_port, default=None, metavar="PORT",
                       help="serve Prometheus metrics over HTTP at /metrics on this port (0 picks a free one; "
                            "the log says which); off by default")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="interface of the metrics endpoint (default loopback; it has no authentication)")
    serve.add_argument("--max-clients", type=positive_int, default=DEFAULT_MAX_CLIENTS, metavar="N",
                       help="most client sessions at once; a Hello beyond is refused as busy, unless a session "
                            "stalled by its client (no credit left, none granted for --max-client-heartbeat "
                            "seconds) gives its place, the longest stalled first; one whose next batch is still "
                            "being prepared keeps it")
    serve.add_argument("--max-clients-per-peer", type=positive_int, default=None, metavar="N",
                       help="most sessions from one address (every client on this host shares one); default: "
                            "(--max-clients - 1) // 2, so that no two addresses fill the server")
    serve.add_argument("--max-client-heartbeat", type=seconds, default=None, metavar="SECONDS",
                       help="longest heartbeat interval a client may claim: a silent one is dropped after 3 of "
                            "them; also how long a session with no credit left may go without a grant before "
                            "it gives its place on a full server; default: 10 x --heartbeat, at least 30")
    # Given by the supervisor of --processes N to each serving process it starts (not for people).
    serve.add_argument("--serving-process", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--serving-processes", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--supervisor-link", type=non_negative_int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--serving-group", default=None, help=argparse.SUPPRESS)
    storage = serve.add_argument_group("remote datasets (DATASET as s3://bucket/prefix, file://...)")
    storage.add_argument("--cache-dir", metavar="DIR", default=None,
                         help="local copies of remote shards (default: $XDG_CACHE_HOME/fuelline or ~/.cache/fuelline)")
    storage.add_argument("--cache-mb", type=positive_int, default=10240,
                         help="most megabytes of shards kept in --cache-dir; the least recently used go first")
    storage.add_argument("--prefetch", type=non_negative_int, default=1, metavar="BLOCKS",
                         help="blocks ahead of the one being read whose shards are fetched in the background")
    stages = serve.add_argument_group("preprocessing (any dataset)")
    stages.add_argument("--stage", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="a preprocessing stage, f(batch) -> batch, run on every batch (repeatable, in order) "
                             "on threads of its own: the serving loop answers and sends meanwhile, however long "
                             "it takes; MODULE must be importable (on PYTHONPATH)")
    stages.add_argument("--stage-threads", type=non_negative_int, default=0, metavar="N",
                        help="threads that run the stages, each one client's batch at a time, so a client whose "
                             "batches are slow holds one thread; 0: as many as the cores, at least 4")
    multimodal = serve.add_argument_group("converted multimodal datasets (fuelline convert)")
    multimodal.add_argument("--window", type=float, default=2.0, help="window length in seconds")
    multimodal.add_argument("--hop", type=float, default=1.0, help="seconds between window starts")
    multimodal.add_argument("--max-gap", type=int, default=2, help="most missing samples in a row in a valid window")
    multimodal.add_argument("--normalize", choices=["zscore", "none"], default="zscore",
                            help="per-channel z-score with the train split's statistics, or none")
    serve.set_defaults(func=run)


# Flags whose names are not the option's with dashes.
FLAGS = {"window": "--window", "max_gap": "--max-gap"}


def flag(option: str) -> str:
    """The ``fuelline serve`` flag of a source option."""
    return FLAGS.get(option, "--" + option.replace("_", "-"))


def source_options(args: argparse.Namespace) -> SourceOptions:
    """The unit sources' options from ``fuelline serve``'s flags (which share their names)."""
    return SourceOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SourceOptions)})


def _open_source(args: argparse.Namespace):
    from fuelline.server.multimodal.manifest import is_converted_dataset
    from fuelline.server.multimodal.stages import load_stage
    from fuelline.server.sources.parquet import ParquetSource

    options = source_options(args)
    stages = [load_stage(spec) for spec in args.stage]
    if is_converted_dataset(args.dataset):
        from fuelline.server.multimodal.source import WindowSource

        return WindowSource(
            args.dataset, window=args.window, hop=args.hop, max_gap=args.max_gap, normalize=args.normalize,
            stages=stages, options=options,
        )
    return ParquetSource(args.dataset, options, stages=stages)


def _describe(info: Mapping[str, Any]) -> str:
    if info["kind"] == "multimodal-windows":
        dropped = ", ".join(f"{k}: {v}" for k, v in info["dropped"].items()) or "none"
        return f"windows of {info['recordings']} recordings; dropped {dropped}"
    return f"{info['files']} files, {info['row_groups']} row groups"


def _answer_to_supervisor(server, fd: int, group: str | None) -> None:
    """Over the link to the supervisor that started this process: say from the serving loop's turns,
    at most twice a second, that it runs (one not heard for long is hung, and killed), and stop serving once the
    supervisor is gone (its end closes however it ends, kill -9 included), removing the folder it
    shared with its siblings."""
    import shutil
    import socket
    import threading
    import time

    link = socket.socket(fileno=fd)
    last = [0.0]

    def beat() -> None:
        # At most twice a second, however short --heartbeat makes the loop's turns: the supervisor
        # counts a process hung after 3 s at the least, and each beat wakes it.
        now = time.monotonic()
        if now - last[0] < 0.5:
            return
        last[0] = now
        try:
            link.send(b".", socket.MSG_DONTWAIT)
        except OSError:  # (full: the supervisor has plenty to read; gone: the watch below stops us)
            pass

    def watch() -> None:
        try:
            while link.recv(4096):
                pass
        except OSError:
            pass
        server.stop("server shutting down (its supervisor is gone)")
        if group is not None:
            shutil.rmtree(group, ignore_errors=True)  # (the supervisor would have, had it stopped)

    threading.Thread(target=watch, name="fuelline-supervisor-watch", daemon=True).start()
    server.on_turn = beat


def _run_processes(args: argparse.Namespace) -> int:
    """``--processes N`` (N > 1): start N serving processes on the port and supervise them."""
    import os
    import signal
    import sys

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.processes > cores:
        log.warning("--processes %d with %d cores for this server: a serving process uses about one core, so "
                    "processes beyond the cores add memory and decoding, not throughput", args.processes, cores)

    from fuelline.server.serving.metrics_merge import serve_merged_metrics
    from fuelline.server.serving.processes import ServingProcesses

    command_line = getattr(args, "command_line", None) or sys.argv[1:]  # (main() records it)
    with ServingProcesses(command_line, args.processes, args.host, args.port,
                          metrics=args.metrics_port is not None, heartbeat=args.heartbeat) as processes:
        def on_signal(signum, frame) -> None:
            processes.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if args.metrics_port is not None:
            try:
                serve_merged_metrics(processes, args.metrics_port, args.metrics_host)
            except OSError as exc:
                raise DataError(f"--metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: {exc}") from None
        processes.start()
        return processes.run()


def run(args: argparse.Namespace) -> int:
    from fuelline.server.serving.keys import CurveConfig
    from fuelline.server.serving.server import Server
    from fuelline.server.serving.start import serve_until_signalled

    _check_exposure(args)
    curve = CurveConfig.from_dir(args.curve_keys) if args.curve_keys else None  # before the dataset: fail fast
    if args.status_interval < 0:
        raise DataError(f"--status-interval must be >= 0 seconds, got {args.status_interval}")
    if args.processes > 1:
        return _run_processes(args)
    if args.serving_process is not None:
        from fuelline.protocol.common.logs import configure_logging

        configure_logging(args.log_level, args.log_format, tags={"serving_process": args.serving_process})
    try:
        source = _open_source(args)
    except OptionError as exc:  # (a library error names the argument; here the flag)
        raise DataError(f"{flag(exc.option)} {exc.rule}") from None
    _log_splits(source, args.batch_size)
    server = Server(source, host=args.host, port=args.port, hwm=args.hwm, heartbeat=args.heartbeat, checksum=args.checksum,
                    curve=curve, status_interval=args.status_interval, memory_cache=args.memory_cache,
                    local_ipc=args.local_ipc, shared_memory=args.shared_memory, insecure=args.insecure, max_clients=args.max_clients,
                    max_clients_per_peer=args.max_clients_per_peer, max_client_heartbeat=args.max_client_heartbeat,
                    share_port=args.serving_process is not None)
    try:
        server.bind()
    except Exception as exc:
        raise DataError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    if args.metrics_port is not None:
        _serve_metrics(server, args)
    if args.serving_process is not None:
        _join_serving_group(server, args)
    if args.serving_processes is not None:
        server.serving_processes = args.serving_processes
    if args.supervisor_link is not None:
        _answer_to_supervisor(server, args.supervisor_link, args.serving_group)
    try:
        serve_until_signalled(server, exiting=True)
    finally:
        source.close()  # worker processes, prefetch threads (a stage still running is abandoned)
    return 0


def _check_exposure(args: argparse.Namespace) -> None:
    """No unencrypted serving beyond loopback unless the user says the network is private."""
    from fuelline.server.serving.keys import is_loopback

    if not args.curve_keys and not args.insecure and not is_loopback(args.host):
        raise DataError(
            f"refusing to serve on --host {args.host} without --curve-keys: anyone who can reach the port could "
            "read the data. Create keys (`fuelline keygen keys/`, `fuelline keygen ckeys/ --name client`, then copy "
            "keys/server.key to ckeys/ and ckeys/client.key to keys/authorized/) and serve with --curve-keys keys/; "
            "or pass --insecure on a network that is private by other means"
        )


def _log_splits(source: BatchSource, batch_size: int) -> None:
    for split in source.splits:
        info = source.info(split)
        log.info(
            "split %r: %d rows (%s); %d batches of %d per epoch at world size 1; up to %.0f MB held per client",
            split, info["rows"], _describe(info), source.batches_per_epoch(split, 0, 1),
            batch_size, source.memory_per_client(split) / 1e6,
        )


def _serve_metrics(server: Server, args: argparse.Namespace) -> None:
    """--metrics-port; a serving process of several says where, for its supervisor to merge."""
    from fuelline.server.serving.metrics import serve_metrics

    try:
        bound = serve_metrics(server, args.metrics_port, args.metrics_host)
    except OSError as exc:
        raise DataError(f"--metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: {exc}") from None
    if args.serving_process is not None:
        from fuelline.server.serving.processes import METRICS_LINE

        print(METRICS_LINE.format(port=bound), flush=True)


def _join_serving_group(server: Server, args: argparse.Namespace) -> None:
    """One of several serving processes: offer clients on this host the group's Unix sockets in turn."""
    if args.serving_group is not None and server.local is not None:
        from fuelline.server.serving.local_group import LocalGroup

        group = LocalGroup(args.serving_group, args.serving_process)
        try:
            group.publish(server.local)
            server.local_offer = group.offer
        except OSError as exc:  # (a full /dev/shm, say): serve, offering only this process's own socket
            log.warning("cannot tell the other serving processes of this one's Unix socket (%s): clients on this "
                        "host that reach it over TCP stay with it", exc)
