"""A simulated trainer rank: the real ``Link`` to every server, on the simulated network, and
its training steps, which take one batch at a time from its links in turn."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from benchmarks.simulation.network import Pipe
from fuelline.client.link import Connect, Disconnect, Item, Link, Transmit
from fuelline.protocol import Hello

if TYPE_CHECKING:
    from benchmarks.simulation.world import World

__all__ = ["NoJitter", "Rank", "SimLink"]


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
        self.first_after_restart: float | None = None

    def act(self) -> None:
        """Carry out what the link returned, in order (after every call into it)."""
        for action in self.take_actions():
            if isinstance(action, Transmit):
                assert self.pipe is not None
                self.world.to_server(self.pipe, [bytes(memoryview(f)) for f in action.frames], action.kind)
            elif isinstance(action, Connect):
                self.pipe = self.world.new_pipe(self)
            elif isinstance(action, Disconnect):
                self.vanish()

    def vanish(self) -> None:
        """Its pipe closes (a Disconnect; or the rank killed, without a word)."""
        if self.pipe is not None:
            self.pipe.open = False
            self.pipe = None

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
            link.act()
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
            link.vanish()
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
                link.act()
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
            link.act()

    def keep_alive(self, job: int) -> None:
        """Each link's keep-alive turn: reconnect once a backoff is over, return credit, heartbeats."""
        w = self.world
        if not self.alive or job != w.job:
            return
        for link in self.links:
            due = link._error is None and link.reconnect_due()
            link.act()
            if not due:
                continue
            link._flush_credit(link._credit_group)
            link.tick()
            link.act()
            if link._undelivered > w.cfg.hwm:
                w.violate(f"credit: rank {self.index} holds {link._undelivered} batches of {link.endpoint} (hwm {w.cfg.hwm})")
        w.loop.after(w.tick, self.keep_alive, job)


class NoJitter(random.Random):
    """Backoff without jitter: every draw at the top of its range (the full backoff)."""

    def uniform(self, a: float, b: float) -> float:
        return b
