"""A deterministic simulation of the protocol at scale: ``python -m benchmarks.simulation``.

The real state machines (``fuelline.server.serving.core.ServingCore``, ``fuelline.client.link.Link``)
on a simulated network and clock (``benchmarks.simulation.world``), with faults
(``benchmarks.simulation.faults``). One seed fixes a run; a run that breaks an invariant names
the seed, and the same seed breaks it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from benchmarks.simulation.faults import restart_all, schedule_faults
from benchmarks.simulation.world import Config, World, quiet_logs

__all__ = ["Config", "Outcome", "Storm", "job_length", "run", "storm"]


@dataclass
class Outcome:
    seed: int
    cfg: Config
    violations: list[str]
    faults: list[str]
    finished: int
    simulated: float  # seconds
    wall: float  # seconds of the host
    events: int
    reconnects: int
    hellos: int
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations and self.finished == self.cfg.ranks


def job_length(cfg: Config) -> float:
    """Simulated seconds a job takes without faults: a step per batch and per end of epoch."""
    return cfg.epochs * (cfg.batches + 1) * cfg.servers * cfg.step


def _deadline(cfg: Config) -> float:
    """Simulated seconds a run may take: its steps three times over, and a minute for faults."""
    return 3 * job_length(cfg) + 60.0


def _outcome(world: World, faults: list[str], wall: float, to_the_end: bool = True) -> Outcome:
    if to_the_end:
        world.check_end()
    return Outcome(
        seed=world.seed, cfg=world.cfg, violations=list(world.violations), faults=faults, finished=world.finished,
        simulated=world.loop.now, wall=wall, events=world.loop.events,
        reconnects=sum(link.reconnects for r in world.ranks for link in r.links),
        hellos=sum(len(h.hellos) for h in world.hosts),
    )


def run(cfg: Config, seed: int, faults: bool = True, schedule: Callable[[World], list[str]] | None = None) -> Outcome:
    """One job from start to end, with the faults its seed draws (or those ``schedule`` sets on the world)."""
    with quiet_logs():
        start = time.perf_counter()
        world = World(cfg, seed)
        deadline = _deadline(cfg)
        if schedule is not None:
            scheduled = schedule(world)
        else:
            scheduled = schedule_faults(world, until=0.8 * job_length(cfg)) if faults else []
        world.launch()
        world.run(deadline)
        return _outcome(world, scheduled, time.perf_counter() - start)


@dataclass
class Storm:
    """What every server's restart at once does: Hellos per server per second, time to read again."""

    outcome: Outcome
    peak_hellos_per_s: float  # the busiest server's busiest 100 ms, per second
    peak_hellos_1s: int  # the busiest server's busiest second (sliding over 100 ms steps)
    hellos_per_server: float  # after the restart, on average
    time_to_read_again: float  # from the servers' return until every link received a batch again
    median_to_read_again: float


def storm(cfg: Config, seed: int, at: float, down: float) -> Storm:
    """Every server killed at ``at`` and back ``down`` seconds later, on a job without other faults,
    run until every link has received a batch from its server's new process. The job has batches
    enough that no link runs out before then; what the ranks read meanwhile is checked against
    the reference as they read it."""
    with quiet_logs():
        start = time.perf_counter()
        world = World(cfg, seed)
        restart_all(world, at, down)
        world.launch()
        links = [link for r in world.ranks for link in r.links]
        world.loop.run(at + down + 60.0, lambda: world.read_again >= len(links))
    outcome = _outcome(world, [f"every server restarted at {at:.2f}s, down {down:.2f}s"], time.perf_counter() - start,
                       to_the_end=False)
    back = world.restarted_at
    bins: list[int] = []
    per_second: list[int] = []
    after = 0
    for host in world.hosts:
        times = [t - back for t in host.hellos if t >= back]
        after += len(times)
        counts: dict[int, int] = {}
        for t in times:
            counts[int(t / 0.1)] = counts.get(int(t / 0.1), 0) + 1
        bins.append(max(counts.values(), default=0))
        per_second.append(max((sum(counts.get(b + i, 0) for i in range(10)) for b in counts), default=0))
    reads = sorted((link.first_after_restart or float("inf")) - back for link in links)
    return Storm(
        outcome=outcome, peak_hellos_per_s=10.0 * max(bins, default=0), peak_hellos_1s=max(per_second, default=0),
        hellos_per_server=after / max(1, len(world.hosts)),
        time_to_read_again=reads[-1] if reads else float("nan"),
        median_to_read_again=reads[len(reads) // 2] if reads else float("nan"),
    )
