"""What goes wrong in a simulated job: restarts, partitions, frozen and slow servers, lying peers,
the whole job restarting. Each is scheduled on a ``World`` at simulated times drawn from its seed."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from benchmarks.simulation.network import Pipe
from benchmarks.simulation.world import World
from fuelline.protocol import Batch, Credit, Heartbeat, Hello, encode

__all__ = ["Liar", "schedule_faults", "restart_all", "job_restart"]


def restart(world: World, server: int, at: float, down: float) -> None:
    """kill -9 of a server at ``at``, started again with the same arguments ``down`` seconds later."""
    host = world.hosts[server]
    world.loop.at(at, host.crash)
    world.loop.at(at + down, host.start)


def restart_all(world: World, at: float, down: float) -> None:
    """Every server restarted at once (a rolling update gone wrong, a power cut): the storm."""
    def back() -> None:
        world.restarted_at = world.loop.now
        for host in world.hosts:
            host.start()

    for host in world.hosts:
        world.loop.at(at, host.crash)
    world.loop.at(at + down, back)


def freeze(world: World, server: int, at: float, length: float) -> None:
    """SIGSTOP, then SIGCONT: what arrived meanwhile waits in the kernel, and is read after."""
    host = world.hosts[server]

    def stop() -> None:
        if not host.down:
            host.frozen = True

    world.loop.at(at, stop)
    world.loop.at(at + length, host.thaw)


def slow(world: World, server: int, at: float, length: float, factor: float) -> None:
    """A server whose every request and batch costs ``factor`` times as much (a busy host)."""
    host = world.hosts[server]

    def begin() -> None:
        host.slow = factor

    def end() -> None:
        host.slow = 1.0

    world.loop.at(at, begin)
    world.loop.at(at + length, end)


def partition(world: World, peer: str, server: int, at: float, length: float) -> None:
    """Nothing passes between one trainer host and one server for ``length`` seconds (both ways:
    what was sent meanwhile is lost)."""
    world.loop.at(at, world.partitioned.add, (peer, server))
    world.loop.at(at + length, world.partitioned.discard, (peer, server))


def job_restart(world: World, at: float, down: float) -> None:
    """Every rank killed at once, and the job launched again from its checkpoint ``down`` seconds
    later (torchrun's restart): the servers meet new clients at old positions."""
    def kill() -> None:
        for rank in world.ranks:
            rank.kill()
        world.job += 1

    def relaunch() -> None:
        world.finished = 0
        for rank in world.ranks:
            if rank.done():
                world.finished += 1
            else:
                rank.launch()

    world.loop.at(at, kill)
    world.loop.at(at + down, relaunch)


class Liar:
    """A peer that lies to one server, now and then: credit no client could grant, Hellos for what
    is not served, garbage, a Batch (which only servers send), Hellos that never read, a heartbeat
    interval of an hour. Sometimes on a new connection, sometimes on its old one."""

    def __init__(self, world: World, server: int, index: int, rng: random.Random) -> None:
        self.world, self.server, self.index, self.rng = world, server, index, rng
        self.peer = f"10.9.{server // 256}.{server % 256}"
        self.pipe: Pipe | None = None
        self.n = 0

    def receive(self, frames: Any) -> None:
        pass  # (a liar reads nothing it is sent)

    def act(self) -> None:
        w = self.world
        if self.pipe is None or self.rng.random() < 0.3:
            if self.pipe is not None:
                self.pipe.open = False
            self.pipe = Pipe(self, self.server, self.rng.randbytes(16), self.peer, self.rng.random() * 0.1)
            w._pipes[self.server][self.pipe.rid] = self.pipe
            self.pipe.connected = not w.hosts[self.server].down
        self.n += 1
        client = f"liar{self.server}.{self.index}"
        lies: list[tuple[list[Any], str]] = [
            (encode(Hello(client_id=client, credit=2)), "hello"),
            (encode(Credit(10**6)), "credit"),
            (encode(Hello(client_id=client, split="nope")), "hello"),
            ([b"\x92\xa5fuel\xcc"], "garbage"),
            (encode(Batch(1, 0, 0, {"id": np.zeros(4, dtype=np.int64)})), "batch"),
            (encode(Hello(client_id=f"{client}.{self.n}", credit=0, heartbeat=3600.0)), "hello"),
            (encode(Hello(client_id=client, rank=10**6, world_size=10**6 + 1, credit=10)), "hello"),
            (encode(Heartbeat()), "heartbeat"),
        ]
        frames, kind = lies[self.rng.randrange(len(lies))]
        w.to_server(self.pipe, frames, kind)
        w.loop.after(0.5 + self.rng.random(), self.act)


def schedule_faults(world: World, until: float, *, restarts: int = 2, freezes: int = 1, slows: int = 1,
                    partitions: int = 2, job_restarts: int = 1) -> list[str]:
    """Faults at times drawn from the world's seed within ``(0.5, until)``; what was scheduled, in words."""
    cfg, rng = world.cfg, random.Random(world.seed * 7919 + 1)
    hb = cfg.heartbeat
    done: list[str] = []

    def when() -> float:
        return 0.5 + rng.random() * (until - 0.5)

    for _ in range(restarts):
        k, t, d = rng.randrange(cfg.servers), when(), rng.uniform(0.05, 4 * hb)
        restart(world, k, t, d)
        done.append(f"restart server {k} at {t:.2f}s, down {d:.2f}s")
    for _ in range(freezes):
        k, t, d = rng.randrange(cfg.servers), when(), rng.uniform(hb, 6 * hb)
        freeze(world, k, t, d)
        done.append(f"freeze server {k} at {t:.2f}s for {d:.2f}s")
    for _ in range(slows):
        k, t, d = rng.randrange(cfg.servers), when(), rng.uniform(hb, 6 * hb)
        slow(world, k, t, d, 50.0)
        done.append(f"slow server {k} (x50) at {t:.2f}s for {d:.2f}s")
    for _ in range(partitions):
        peer, k, t = world.ranks[rng.randrange(cfg.ranks)].peer, rng.randrange(cfg.servers), when()
        d = rng.uniform(0.1, 6 * hb)
        partition(world, peer, k, t, d)
        done.append(f"partition {peer} from server {k} at {t:.2f}s for {d:.2f}s")
    for _ in range(job_restarts):
        t, d = when(), rng.uniform(0.1, 3 * hb)
        job_restart(world, t, d)
        done.append(f"job restart at {t:.2f}s, down {d:.2f}s")
    for k in range(cfg.servers):
        for i in range(cfg.liars):
            liar = Liar(world, k, i, random.Random(rng.getrandbits(64)))
            world.loop.after(rng.random(), liar.act)
    if cfg.liars:
        done.append(f"{cfg.liars} lying peers per server")
    return done
