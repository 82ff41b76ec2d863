"""A simulated cluster: data servers and trainer ranks on a simulated network and clock.

The protocol is the real one: every server is a ``ServingCore`` and every rank's connection to
a server a ``Link``, the same objects ``fuelline serve`` and ``ServerDataStream`` drive, exchanging
the real encoded messages. Only their surroundings are simulated: time (an event queue, so a
minute of a thousand ranks runs in seconds of the host's), the network (latency, libzmq's
queueing while a peer is down and its reconnect interval, messages lost in a partition or with a
killed process), the servers' CPU (a cost per request and per batch sent, so that a flood of
Hellos queues) and the ranks' training steps. One seed fixes everything that happens.

Checked while it runs, and at the end (``World.violations``):
- order: every rank reads, from every server, exactly the reference sequence of batches and
  ends of epoch (nothing lost, nothing twice), across server restarts, partitions, frozen and
  slow servers, lying peers and the whole job restarting from its checkpoint;
- credit: no session ever has more than hwm batches in flight, no link holds more than hwm;
- silence: a link that hears nothing from its server for 3 of the server's heartbeats has
  reconnected by its next turn, and a server drops a session silent for 3 of its client's;
- admission: no server ever holds more sessions than its caps allow;
- the server's own failures: no request or session turn ever raised inside a server.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

from benchmarks.simulation.network import ZMQ_RECONNECT_IVL, Loop, Pipe
from benchmarks.simulation.ranks import NoJitter, Rank, SimLink
from benchmarks.simulation.servers import Host, code
from fuelline.server.serving.admission import default_per_peer

__all__ = ["Config", "World", "reference", "quiet_logs"]


@dataclass(frozen=True)
class Config:
    """One simulated job. Times in simulated seconds."""

    ranks: int = 16
    servers: int = 4
    ranks_per_host: int = 8
    epochs: int = 4
    batches: int = 8  # per rank, per server, per epoch
    hwm: int = 4
    heartbeat: float = 0.5  # the servers' and the clients' interval
    step: float = 0.05  # a rank's training step: one batch, from its links in turn
    latency: tuple[float, float] = (100e-6, 400e-6)  # one way, uniform
    jitter: bool = True  # the links' reconnect backoff is jittered (the default); False: the full backoff
    liars: int = 2  # lying peers per server
    max_clients: int | None = None  # per server; None: room for every rank and liar, plus a quarter
    timeout: float = 120.0  # a link's ServerUnavailable


def reference(cfg: Config, server: int, rank: int) -> list[tuple]:
    out: list[tuple] = []
    for epoch in range(cfg.epochs):
        out += [("batch", epoch, seq, code(server, epoch, rank, seq)) for seq in range(cfg.batches)]
        out.append(("end", epoch, cfg.batches, None))
    return out


@dataclass
class World:
    cfg: Config
    seed: int = 0
    loop: Loop = field(default_factory=Loop)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.rng = random.Random(self.seed)
        self.job = 1
        self.finished = 0
        self.read_again = 0  # links that received a batch from their server's new process
        self.tick = cfg.heartbeat / 4
        self.max_clients = cfg.max_clients or (cfg.ranks + cfg.liars) * 5 // 4 + 2
        self.per_peer = default_per_peer(self.max_clients)
        self.references = {(k, r): reference(cfg, k, r) for k in range(cfg.servers) for r in range(cfg.ranks)}
        self.hosts = [Host(self, k) for k in range(cfg.servers)]
        self.ranks = [Rank(self, r) for r in range(cfg.ranks)]
        self._pipes: list[dict[bytes, Pipe]] = [{} for _ in range(cfg.servers)]
        self.partitioned: set[tuple[str, int]] = set()  # (peer, server) pairs that cannot reach each other
        self.logs = Counter[str]()
        for host in self.hosts:
            host.start()
            self.loop.after(self.tick * self.rng.random(), host.keepalive)

    # -- the network ----------------------------------------------------------------------------
    def jitter_rng(self) -> random.Random:
        seed = self.rng.getrandbits(64)
        return random.Random(seed) if self.cfg.jitter else NoJitter(seed)

    def latency(self) -> float:
        lo, hi = self.cfg.latency
        return lo + (hi - lo) * self.rng.random()

    def new_pipe(self, link: SimLink) -> Pipe:
        pipe = Pipe(link, link.server, self.rng.randbytes(16), link.rank.peer, self.rng.random() * ZMQ_RECONNECT_IVL)
        self._pipes[link.server][pipe.rid] = pipe
        if not self.hosts[link.server].down:
            pipe.connected = True
        return pipe

    def open_pipes(self, server: int) -> list[Pipe]:
        pipes = self._pipes[server]
        for rid in [rid for rid, p in pipes.items() if not p.open]:
            del pipes[rid]
        return list(pipes.values())

    def next_try(self, pipe: Pipe) -> float:
        """When libzmq's next connection attempt of this socket comes (every reconnect interval)."""
        now = self.loop.now
        return now + (pipe.phase - now) % ZMQ_RECONNECT_IVL

    def connect(self, pipe: Pipe) -> None:
        host = self.hosts[pipe.server]
        if not pipe.open or host.down or pipe.connected:
            return
        pipe.connected = True
        pending, pipe.pending = pipe.pending, []
        for frames, kind in pending:
            self.to_server(pipe, frames, kind)

    def to_server(self, pipe: Pipe, frames: list[Any], kind: str) -> None:
        host = self.hosts[pipe.server]
        if not pipe.connected:
            pipe.pending.append((frames, kind))  # (libzmq queues it until it connects)
            return
        if (pipe.peer, pipe.server) in self.partitioned:
            return
        pipe.up_at = max(pipe.up_at, self.loop.now + self.latency())
        self.loop.at(pipe.up_at, host.arrive, pipe, frames, kind, host.incarnation)

    def to_client(self, pipe: Pipe, frames: list[Any]) -> None:
        if (pipe.peer, pipe.server) in self.partitioned:
            return
        pipe.down_at = max(pipe.down_at, max(self.hosts[pipe.server].out_at, self.loop.now) + self.latency())
        self.loop.at(pipe.down_at, self.deliver, pipe, frames)

    def deliver(self, pipe: Pipe, frames: list[Any]) -> None:
        link = pipe.link
        if not pipe.open or link.pipe is not pipe:
            return  # (a closed socket drops what arrives)
        if not isinstance(link, SimLink):
            link.receive(frames)
            return
        before = link._undelivered
        link.receive(frames)
        link.act()
        if link._undelivered > before:
            host = self.hosts[pipe.server]
            if link.first_after_restart is None and host.incarnation > 1 and self.loop.now >= self.restarted_at:
                link.first_after_restart = self.loop.now
                self.read_again += 1
            if link._undelivered > self.cfg.hwm:
                self.violate(f"credit: rank {link.rank.index} holds {link._undelivered} batches of {link.endpoint} "
                             f"(hwm {self.cfg.hwm})")

    restarted_at = float("inf")

    # -- invariants -----------------------------------------------------------------------------
    def violate(self, what: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(f"t={self.loop.now:.3f}s seed {self.seed}: {what}")

    def check_server(self, host: Host) -> None:
        """After each turn: the total cap, and no failure inside the server (the per-session
        checks are ``check_sessions``, at every keep-alive turn)."""
        core = host.core
        if core is None:
            return
        n = len(core.sessions)
        host.peak_sessions = max(host.peak_sessions, n)
        if n > self.max_clients:
            self.violate(f"admission: server {host.index} holds {n} sessions (cap {self.max_clients})")
        if core.stats["errors"]:
            self.violate(f"server {host.index} failed {core.stats['errors']} times inside a request or turn")
            core.stats["errors"] = 0

    def check_sessions(self, host: Host) -> None:
        """At each keep-alive turn: per-address caps, credit, silence."""
        core = host.core
        assert core is not None
        sessions = core.sessions.values()
        per_peer = Counter(s.peer for s in sessions)
        if per_peer and max(per_peer.values()) > self.per_peer:
            self.violate(f"admission: server {host.index} holds {max(per_peer.values())} sessions of one peer")
        now = self.loop.now
        for s in sessions:
            if s.in_flight > self.cfg.hwm:
                self.violate(f"credit: server {host.index} has {s.in_flight} batches in flight to {s.name}")
            if now - s.last_heard > 3 * s.client_heartbeat + 1e-9:
                self.violate(f"silence: server {host.index} keeps {s.name}, silent for {now - s.last_heard:.3f}s")

    def check_end(self) -> None:
        for rank in self.ranks:
            for k in range(self.cfg.servers):
                got, want = len(rank.read[k]), len(self.references[(k, rank.index)])
                if got != want:
                    self.violate(f"order: rank {rank.index} read {got} of {want} items from server {k} by the end")
                    return

    # -- running ----------------------------------------------------------------------------------
    def launch(self) -> None:
        for rank in self.ranks:
            rank.launch()

    def all_done(self) -> bool:
        return self.finished >= len(self.ranks)

    def run(self, until: float) -> None:
        self.loop.run(until, self.all_done)


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The simulation's thousands of reconnects are its point, not news: fuelline's logs above
    errors only while it runs, and as they were after."""
    loggers = [logging.getLogger(name) for name in ("fuelline.server", "fuelline.client")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
