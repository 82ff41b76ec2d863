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

import heapq
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from fuelline.client.link import Item, Link
from fuelline.protocol import Hello
from fuelline.server.serving.admission import default_per_peer
from fuelline.server.serving.core import Sent, ServingCore
from fuelline.server.sources.contract import BatchSource

__all__ = ["Config", "World", "SimSource", "reference"]

ZMQ_RECONNECT_IVL = 0.1  # libzmq's default: a connecting socket tries again every 100 ms
COST_HELLO = 300e-6  # seconds of a server's CPU: a Hello (admission, a session, a Welcome)
COST_REQUEST = 20e-6  # a Credit, a Heartbeat, a Bye, a malformed message
COST_BATCH = 40e-6  # a batch prepared and sent
COST_SESSION_TURN = 2e-6  # each session, each turn of the serving loop (what it may send is looked at)


class Loop:
    """Simulated time: callbacks in the order of their times (ties in the order scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._n = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (max(t, self.now), self._n, fn, args))
        self._n += 1

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float, done: Callable[[], bool] = lambda: False) -> None:
        queue = self._queue
        while queue and queue[0][0] <= until and not done():
            t, _, fn, args = heapq.heappop(queue)
            self.now = t
            self.events += 1
            fn(*args)


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


def code(server: int, epoch: int, rank: int, seq: int) -> int:
    """What batch ``seq`` of ``epoch`` for ``rank`` holds, from ``server``."""
    return ((server * 1009 + epoch) * 1_000_003 + rank) * 10_007 + seq


def reference(cfg: Config, server: int, rank: int) -> list[tuple]:
    out: list[tuple] = []
    for epoch in range(cfg.epochs):
        out += [("batch", epoch, seq, code(server, epoch, rank, seq)) for seq in range(cfg.batches)]
        out.append(("end", epoch, cfg.batches, None))
    return out


class SimSource(BatchSource):
    """One array per batch, ``id``, whose value names the batch (``code``)."""

    cooperative = True
    immutable_batches = True

    def __init__(self, server: int, batches: int) -> None:
        super().__init__()
        self.server, self.batches = server, batches

    @property
    def sources(self) -> tuple[str, ...]:
        return ("id",)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train",)

    def schema(self) -> Mapping[str, Mapping[str, Any]]:
        return {"id": {"dtype": "int64", "shape": []}}

    def info(self, split: str) -> Mapping[str, Any]:
        return {}

    def fingerprint(self, split: str) -> dict[str, str]:
        return {"source": f"simulated server {self.server}", "batches": str(self.batches)}

    def batches_per_epoch(self, split: str, rank: int, world_size: int) -> int | None:
        return self.batches

    def iter_batches(self, split: str, epoch: int, rank: int, world_size: int, start: int,
                     sources: tuple[str, ...], on_loss: Any = None, history: Sequence = ()) -> Iterator[dict]:
        for seq in range(start, self.batches):
            yield {"id": np.array([code(self.server, epoch, rank, seq)], dtype=np.int64)}

    def close(self) -> None:
        pass


class Pipe:
    """One connection, as libzmq keeps it: a DEALER's routing id, its queue while not connected."""

    __slots__ = ("link", "server", "rid", "peer", "open", "connected", "pending", "phase", "up_at", "down_at")

    def __init__(self, link: Any, server: int, rid: bytes, peer: str, phase: float) -> None:
        self.link, self.server, self.rid, self.peer = link, server, rid, peer
        self.open = True
        self.connected = False
        self.pending: list[tuple[list[Any], str]] = []
        self.phase = phase  # when, within libzmq's reconnect interval, this socket tries again
        # When the last message each way arrives: a connection delivers in order (TCP).
        self.up_at = self.down_at = 0.0


class Host:
    """A data server's host: the serving core of its current process, and what the process does."""

    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.incarnation = 0
        self.core: ServingCore | None = None
        self.down = True
        self.frozen = False
        self.slow = 1.0  # factor on the CPU costs
        self.busy_until = 0.0
        self.pipes: dict[bytes, Pipe] = {}  # connected pipes, by routing id
        self.inbox: list[tuple[Pipe, list[Any], str]] = []  # requests waiting for the next turn
        self.turn_due = False  # a turn is scheduled
        self.out_at = 0.0  # during a turn: when what the server sends now leaves
        self.hellos: list[float] = []  # when each Hello was handled
        self.peak_sessions = 0

    def start(self) -> None:
        w = self.world
        self.incarnation += 1
        core = SimCore(self, SimSource(self.index, w.cfg.batches), hwm=w.cfg.hwm, heartbeat=w.cfg.heartbeat,
                       max_clients=w.max_clients, clock=lambda: w.loop.now)
        self.core, self.down, self.frozen, self.busy_until = core, False, False, w.loop.now
        self.inbox.clear()
        self.turn_due = False
        self.pipes.clear()
        for pipe in w.open_pipes(self.index):  # libzmq connects at its next try
            w.loop.at(w.next_try(pipe), w.connect, pipe)

    def crash(self) -> None:
        self.down, self.core = True, None
        self.pipes.clear()
        self.inbox.clear()
        self.turn_due = False
        for pipe in self.world.open_pipes(self.index):
            pipe.connected = False

    def arrive(self, pipe: Pipe, frames: list[Any], kind: str, incarnation: int) -> None:
        if self.down or incarnation != self.incarnation or not pipe.connected:
            return  # (lost with the process it was sent to, or with a connection closed meanwhile)
        self.inbox.append((pipe, frames, kind))
        if not self.frozen and not self.turn_due:
            self.turn_due = True
            self.world.loop.at(self.busy_until, self.serve_turn, self.incarnation)

    def serve_turn(self, incarnation: int) -> None:
        """A turn of the serving loop: the requests that arrived (up to 1,000), then every session
        sends what it may and prepares what it can. The server's CPU is busy meanwhile: what
        arrives waits for the next turn, and what it sends leaves as each step is done."""
        core = self.core
        if core is None or incarnation != self.incarnation:
            return
        self.turn_due = False
        if self.frozen:
            return  # (thaw turns again)
        now = self.world.loop.now
        requests, self.inbox = self.inbox[:1000], self.inbox[1000:]
        spent = 0.0
        for pipe, frames, kind in requests:
            self.out_at = now + spent
            if kind == "hello":
                self.hellos.append(self.out_at)
            self.pipes[pipe.rid] = pipe
            core._guarded(pipe.rid, "handling a request", core._handle, pipe.rid, frames, pipe.peer, peer=pipe.peer)
            spent += (COST_HELLO if kind == "hello" else COST_REQUEST) * self.slow
        self.out_at = now + spent
        self.turn(spent)

    def turn(self, spent: float = 0.0) -> None:
        core = self.core
        assert core is not None
        now = self.world.loop.now
        before = core.stats["batches"]
        for _ in range(100):
            busy, _blocked = core._turn()
            if not busy:
                break
        core._drop_vanished()
        sent = core.stats["batches"] - before
        spent += (sent * COST_BATCH + len(core.sessions) * COST_SESSION_TURN) * self.slow
        self.busy_until = max(self.busy_until, now + spent)
        self.out_at = 0.0
        self.world.check_server(self)
        if self.inbox and not self.turn_due and not self.frozen:
            self.turn_due = True
            self.world.loop.at(self.busy_until, self.serve_turn, self.incarnation)

    def keepalive(self) -> None:
        w = self.world
        if self.core is not None and not self.frozen:
            self.core._keepalive(w.loop.now)
            self.turn()
            w.check_sessions(self)
        w.loop.after(min(w.cfg.heartbeat / 4, 0.25), self.keepalive)

    def thaw(self) -> None:
        self.frozen = False
        if self.inbox and not self.turn_due and self.core is not None:
            self.turn_due = True
            self.world.loop.at(self.busy_until, self.serve_turn, self.incarnation)


class SimCore(ServingCore):
    """A serving core whose sends go on the simulated network."""

    def __init__(self, host: Host, source: BatchSource, **kwargs: Any) -> None:
        super().__init__(source, **kwargs)
        self.host = host

    def _transmit(self, rid: bytes, frames: list[Any]) -> Sent:
        pipe = self.host.pipes.get(rid)
        if pipe is None or not pipe.open:
            return Sent.GONE
        self.host.world.to_client(pipe, [bytes(memoryview(f)) for f in frames])
        return Sent.OK


class SimLink(Link):
    """A rank's connection to one server, on the simulated network."""

    def __init__(self, world: World, rank: Rank, server: int, jitter: random.Random) -> None:
        cfg = world.cfg
        hello = Hello(client_id=f"rank{rank.index}-job{world.job}/{server}", rank=rank.index, world_size=cfg.ranks,
                      heartbeat=cfg.heartbeat, credit=cfg.hwm)
        super().__init__(f"tcp://server{server}:5557", hello, hwm=cfg.hwm, heartbeat=cfg.heartbeat,
                         timeout=cfg.timeout, local=False, clock=lambda: world.loop.now, rng=jitter)
        self.world, self.rank, self.server = world, rank, server
        self.pipe: Pipe | None = None
        self._kind = ""
        self.first_after_restart: float | None = None

    def _send(self, msg: Any) -> None:
        self._kind = msg.TYPE
        super()._send(msg)

    def _connect(self) -> None:
        self.pipe = self.world.new_pipe(self)

    def _disconnect(self) -> None:
        if self.pipe is not None:
            self.pipe.open = False
            self.pipe = None

    def _transmit(self, frames: list[Any]) -> None:
        assert self.pipe is not None
        self.world.to_server(self.pipe, [bytes(memoryview(f)) for f in frames], self._kind)

    def _heartbeat_or_retry(self, now: float) -> None:
        heard = max(self._last_heard, self._hello_sent)
        limit = 3 * (self._server_heartbeat if self._connected else self._heartbeat)
        if now - heard > limit + self.world.tick + 1e-9 and not self._bye_pending:
            self.world.violate(f"silence: {self.endpoint} for rank {self.rank.index} heard nothing for "
                               f"{now - heard:.3f}s (limit {limit:.3f}s) and still waits")
        super()._heartbeat_or_retry(now)


class Rank:
    """A trainer rank: a link to every server, one batch a step from them in turn."""

    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.peer = f"10.0.{index // world.cfg.ranks_per_host // 256}.{index // world.cfg.ranks_per_host % 256}"
        self.read: list[list[tuple]] = [[] for _ in range(world.cfg.servers)]  # what was taken, per server
        self.complete = 0  # servers whose every item was taken
        self.links: list[SimLink] = []
        self.turn = 0
        self.alive = False
        self.waited = 0.0  # steps spent with no batch to take

    def launch(self) -> None:
        w = self.world
        self.alive = True
        self.links = []
        for k in range(w.cfg.servers):
            epoch, seq = self.position(k)
            link = SimLink(w, self, k, w.jitter_rng())
            self.links.append(link)
            link.begin(w.job, epoch, seq)
        w.loop.after(w.cfg.step * w.rng.random(), self.step)
        w.loop.after(w.tick * w.rng.random(), self.keep_alive, w.job)

    def position(self, server: int) -> tuple[int, int]:
        """Where this rank resumes with ``server``: after the last item it took (its checkpoint)."""
        read = self.read[server]
        if not read:
            return 0, 0
        kind, epoch, seq, _ = read[-1]
        return (epoch + 1, 0) if kind == "end" else (epoch, seq + 1)

    def done(self) -> bool:
        return self.complete == len(self.read)

    def kill(self) -> None:
        """kill -9: the links vanish without a word; what they held and the rank had not taken is lost."""
        self.alive = False
        for link in self.links:
            link._disconnect()
        self.links = []

    def step(self) -> None:
        if not self.alive:
            return
        w = self.world
        n = len(self.links)
        for i in range(n):  # the next link in turn with an item (a link finished is skipped)
            link = self.links[(self.turn + i) % n]
            if link._error is not None:
                w.violate(f"rank {self.index}: {link.endpoint} failed: {link._error}")
                self.kill()
                return
            if len(self.read[link.server]) == len(w.references[(link.server, self.index)]):
                continue
            if not link._items:
                self.waited += 1
                break
            item: Item = link._items.popleft()
            self.take(link, item)
            self.turn = (self.turn + i + 1) % n
            break
        if self.done():
            for link in self.links:
                link.say_bye("done")
                link._close_transport()
            self.alive = False
            w.finished += 1
            return
        w.loop.after(w.cfg.step, self.step)

    def take(self, link: SimLink, item: Item) -> None:
        value = None if item.arrays is None else int(item.arrays["id"][0])
        entry = (item.kind, item.epoch, item.seq, value)
        read = self.read[link.server]
        expected = self.world.references[(link.server, self.index)]
        if len(read) >= len(expected) or expected[len(read)] != entry:
            want = expected[len(read)] if len(read) < len(expected) else "nothing more"
            self.world.violate(f"order: rank {self.index} took {entry} from server {link.server}, expected {want}")
        read.append(entry)
        if len(read) == len(expected):
            self.complete += 1
        if item.kind == "batch":
            link.credit(item.seek, 1)

    def keep_alive(self, job: int) -> None:
        """Each link's keep-alive turn: reconnect once a backoff is over, return credit, heartbeats."""
        w = self.world
        if not self.alive or job != w.job:
            return
        for link in self.links:
            if link._error is not None or not link.reconnect_due():
                continue
            link._flush_credit(link._credit_group)
            link.tick()
            if link._undelivered > w.cfg.hwm:
                w.violate(f"credit: rank {self.index} holds {link._undelivered} batches of {link.endpoint} (hwm {w.cfg.hwm})")
        w.loop.after(w.tick, self.keep_alive, job)


class NoJitter(random.Random):
    """Backoff without jitter: every draw at the top of its range (the full backoff)."""

    def uniform(self, a: float, b: float) -> float:
        return b


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


def quiet_logs() -> None:
    """The simulation's thousands of reconnects are its point, not news: fuelline's logs above errors only."""
    for name in ("fuelline.server", "fuelline.client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
