"""A simulated data server's host: the real serving core of its current process, a source whose
batches name themselves, and what the process does (its turns, its CPU, crashes and freezes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from benchmarks.simulation.network import Pipe
from fuelline.server.serving.core import Sent, ServingCore
from fuelline.server.sources.contract import BatchSource

if TYPE_CHECKING:
    from benchmarks.simulation.world import World

__all__ = ["Host", "SimCore", "SimSource", "code"]

COST_HELLO = 300e-6  # seconds of a server's CPU: a Hello (admission, a session, a Welcome)
COST_REQUEST = 20e-6  # a Credit, a Heartbeat, a Bye, a malformed message
COST_BATCH = 40e-6  # a batch prepared and sent
COST_SESSION_TURN = 2e-6  # each session, each turn of the serving loop (what it may send is looked at)


def code(server: int, epoch: int, rank: int, seq: int) -> int:
    """What batch ``seq`` of ``epoch`` for ``rank`` holds, from ``server``."""
    return ((server * 1009 + epoch) * 1_000_003 + rank) * 10_007 + seq


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
