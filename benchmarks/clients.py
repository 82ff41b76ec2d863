"""Client processes that read from data servers all at once, for the benchmarks that measure
many clients (``benchmarks.scaling``, ``benchmarks.cost``).

``Clients(n)`` spawns n processes once and reuses them: each ``read`` has clients 0…N-1 read
their rank's share of some epochs at the same time, from one server or from several, and returns
a ``Round`` of the aggregate, with the servers' CPU (every process, children included), the
clients' own CPU, the machine's busy CPU, the units the servers decoded and, for a server of
several serving processes, the share of the batches each sent (their merged metrics).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any, Sequence

from benchmarks.common import Round, ServerProcess, processes_cpu_seconds

__all__ = ["Clients", "HWM", "TIMEOUT_S", "metrics_port", "decoded_misses", "sent_by_process", "machine_cpu_seconds"]

HWM = 10
TIMEOUT_S = 60.0


# -- client processes -------------------------------------------------------------------------------
def _client(conn: Connection) -> None:
    """Child process: per request (endpoints, rank, world_size, epochs), read that many epochs
    and report (batches, rows, bytes, rows of the first batch, first arrival, last arrival, CPU
    seconds of this process over the read)."""
    from fuelline.client import ServerDataStream

    while conn.poll(30 * TIMEOUT_S):
        job = conn.recv()
        if job is None:
            break
        endpoints, rank, world, epochs = job
        cpu0 = time.process_time()
        try:
            first = last = None
            count = rows = nbytes = first_rows = 0
            with ServerDataStream(None, endpoints=endpoints, hwm=HWM, rank=rank, world_size=world,
                                  timeout=TIMEOUT_S, receive_timeout=TIMEOUT_S) as stream:
                for _ in range(epochs):
                    for batch in stream.get_epoch_iterator():
                        last = time.monotonic()
                        count += 1
                        for arr in batch:
                            if arr.size:
                                arr.item(0)
                        rows += len(batch[0])
                        nbytes += sum(arr.nbytes for arr in batch)
                        if first is None:
                            first, first_rows = last, len(batch[0])
            conn.send(("ok", count, rows, nbytes, first_rows, first, last, time.process_time() - cpu0))
        except Exception as exc:  # reported to the parent, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def machine_cpu_seconds() -> tuple[float, int]:
    """CPU seconds this machine's cores have been busy (all processes, ours and others'), and
    how many cores it has."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    fields = [float(x) for x in lines[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle, iowait
    cores = sum(1 for line in lines if re.match(r"cpu\d", line))
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), cores


def metrics_port(server: ServerProcess) -> int | None:
    """The port of the server's ``--metrics-port 0`` endpoint, from its log; None where its
    decoded-units counter counts nothing (``--decoded-cache-mb 0`` decodes outside the cache)."""
    argv = server.argv
    if argv[argv.index("--decoded-cache-mb") + 1] == "0":
        return None
    try:
        # (--processes N: the supervisor's endpoint, which serves every process's metrics, logged first)
        found = re.search(r"metrics (?:of the \d+ serving processes )?on http://[^:]+:(\d+)/metrics",
                          server.log_path.read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def decoded_misses(port: int | None) -> float | None:
    """Units the server has decoded so far (``fuelline_cache_misses_total{tier="decoded"}`` from
    its metrics endpoint), or None if it does not say."""
    if port is None:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
        text = reply.read().decode()
    # (one sample per serving process, labelled with its process, under --processes N)
    found = [float(m.group(2)) for m in re.finditer(r'^fuelline_cache_misses_total\{([^}]*)\} (\S+)$', text, re.M)
             if 'tier="decoded"' in m.group(1)]
    return sum(found) if found else None


def _shares(counts: list[float]) -> list[float]:
    total = sum(counts)
    return sorted((c / total for c in counts), reverse=True) if total else []


def sent_by_process(port: int | None) -> dict[str, float] | None:
    """Batches each serving process of a ``--processes N`` server has sent so far (its merged
    metrics, ``fuelline_batches_sent_total{process=…}``), or None for a server of one process."""
    if port is None:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
        text = reply.read().decode()
    found = {m.group(1): float(m.group(2))
             for m in re.finditer(r'^fuelline_batches_sent_total\{process="(\d+)"\} (\S+)$', text, re.M)}
    return found or None


class Clients:
    """``n`` client processes that read concurrently on request.

    ``extras`` holds, by ``id`` of each Round ``read`` returned: the machine's busy CPU seconds
    and its cores over the read, the read's wall seconds, and units the server decoded in it.
    """

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        self.extras: dict[int, dict[str, Any]] = {}
        self._metrics: dict[int, int | None] = {}  # metrics port by server pid
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(child,), name=f"bench-client-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def ask(self, i: int, endpoints: Sequence[str], rank: int, world: int, epochs: int) -> None:
        """Have client ``i`` read ``epochs`` epochs of rank ``rank`` of ``world`` from ``endpoints``
        (HOST:PORT each); it reports on its pipe (``_client``). The one place a job is put into words."""
        self.conns[i].send((list(endpoints), rank, world, epochs))

    def read(self, server: ServerProcess | Sequence[ServerProcess], world: int, epochs: int) -> Round:
        """Clients 0…world-1 read ``epochs`` epochs each, all at once, from a server or from
        several (each client from all of them: ``ServerDataStream(endpoints=...)``). The Round
        counts every window received after the very first batch of any client, over the time
        from that batch to the last batch of any client; the servers' CPU and decodes are added up."""
        servers = [server] if isinstance(server, ServerProcess) else list(server)
        for s in servers:
            if s.pid not in self._metrics:
                self._metrics[s.pid] = metrics_port(s)
        decoded0 = self._decoded(servers)
        sent0 = sent_by_process(self._metrics[servers[0].pid]) if len(servers) == 1 else None
        machine0, cores = machine_cpu_seconds()
        wall0 = time.monotonic()
        cpu0 = processes_cpu_seconds(s.pid for s in servers)
        endpoints = [f"{s.host}:{s.port}" for s in servers]
        for rank in range(world):
            self.ask(rank, endpoints, rank, world, epochs)
        replies = []
        for rank in range(world):
            if not self.conns[rank].poll(10 * TIMEOUT_S):
                raise TimeoutError(f"client {rank} of {world}: no report within {10 * TIMEOUT_S:.0f}s")
            replies.append(self.conns[rank].recv())
        cpu1 = processes_cpu_seconds(s.pid for s in servers)
        wall1 = time.monotonic()
        machine1, _ = machine_cpu_seconds()
        decoded1 = self._decoded(servers)
        sent1 = sent_by_process(self._metrics[servers[0].pid]) if sent0 is not None else None
        errors = [r[1] for r in replies if r[0] != "ok"]
        if errors:
            raise RuntimeError(f"{len(errors)} of {world} clients failed: {errors[0]}")
        if sum(r[1] for r in replies) < 2:
            raise RuntimeError("fewer than two batches arrived: too little data to time")
        earliest = min(replies, key=lambda r: r[5])
        first, last = earliest[5], max(r[6] for r in replies)
        rows = sum(r[2] for r in replies) - earliest[4]
        nbytes = int(sum(r[3] for r in replies) * rows / (rows + earliest[4]))
        producer = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        result = Round(sum(r[1] for r in replies), rows, nbytes, last - first, sum(r[7] for r in replies), producer)
        self.extras[id(result)] = {
            "machine_busy_s": machine1 - machine0, "cores": cores, "wall_s": wall1 - wall0, "epochs": epochs,
            # From asking the clients to read to the first batch of the last of them to get one: what
            # starting a session costs each of them, outside the timed span.
            # (a client that got no batch has no first one: the others' count)
            "start_s": max(r[5] for r in replies if r[5] is not None) - wall0,
            "all_rows": sum(r[2] for r in replies),
            "decoded": None if decoded0 is None or decoded1 is None else decoded1 - decoded0,
            # Of the batches sent, the share of each serving process (a --processes server), largest first.
            "process_shares": None if sent0 is None or sent1 is None else _shares(
                [sent1[k] - sent0.get(k, 0.0) for k in sent1]),
        }
        return result

    def _decoded(self, servers: list[ServerProcess]) -> float | None:
        counts = [decoded_misses(self._metrics[s.pid]) for s in servers]
        return None if None in counts else sum(counts)  # type: ignore[arg-type]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
