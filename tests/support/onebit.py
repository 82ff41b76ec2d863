"""Real gloo process groups for the 1-bit tests, and what their checks share.

``ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned
processes that meet on an ephemeral TCP port and report ready once in the group. Every wait on
the ranks has a deadline, and a rank that fails or hangs tears its group down, so a bug fails a
test instead of blocking the suite.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["BLOCK", "RankGroup", "Ranks", "_assert_replicas_identical", "_message_bytes", "_mlp", "_regression_data",
           "ranks"]

START_TIMEOUT = 60.0
TASK_TIMEOUT = 90.0
BLOCK = 1024


# -- helpers: run functions on every rank of a gloo group ---------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, parent: int, tasks: Any, results: Any) -> None:
    """A rank: join the group, say so, then run ``(fn, args)`` tasks until told to stop."""
    try:
        # Two cores for up to four ranks: more threads per rank would only fight over them.
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
    except BaseException:
        results.put((rank, False, f"in rank {rank}, joining the group:\n{traceback.format_exc()}"))
        return
    results.put((rank, True, "ready"))
    while os.getppid() == parent:  # a dead test runner leaves no orphans behind
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            continue
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, False, f"in rank {rank}, {fn.__name__}:\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankGroup:
    """``world_size`` spawned processes in one gloo group, running test functions on demand.

    Starting a rank (importing torch) costs more CPU than most checks it runs, so one group per
    world size serves the whole module. A failed or silent task closes the group; the next test
    spawns a fresh one.
    """

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world_size, port, os.getpid(), self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self._collect(START_TIMEOUT, "joining the group")

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order."""
        for tasks in self.tasks:
            tasks.put((fn, args))
        return self._collect(TASK_TIMEOUT, fn.__name__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [rank for rank, proc in enumerate(self.procs) if not proc.is_alive()]
                if time.monotonic() < deadline and not dead:
                    continue
                self.close()
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                raise AssertionError(
                    f"{what}: ranks {missing} silent (dead: {dead}, waited up to {timeout}s)\n"
                    + "\n".join(errors.values())
                ) from None
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
                # The other ranks fail on the broken collective soon, or are killed.
                deadline = min(deadline, time.monotonic() + 10.0)
        if errors:
            self.close()
            raise AssertionError("\n".join(errors.values()))
        return [out[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for proc in self.procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)


Ranks = Callable[..., list[Any]]


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    """``ranks(fn, world_size, *args)``: ``fn(rank, world_size, *args)`` on every rank."""
    groups: dict[int, RankGroup] = {}

    def run(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
        group = groups.get(world_size)
        if group is None or not group.alive:
            group = groups[world_size] = RankGroup(world_size)
        return group.run(fn, *args)

    yield run
    for group in groups.values():
        group.close()


def _digest(module: nn.Module) -> torch.Tensor:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _assert_replicas_identical(module: nn.Module, world_size: int, step: int) -> None:
    mine = _digest(module)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(d, everyone[0]) for d in everyone), f"replicas differ after step {step}"


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _regression_data(rank: int, feature_scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Linear regression, 2048 rows, 32 features; rank ``r`` of 2 gets rows ``r::2``."""
    gen = torch.Generator().manual_seed(7)
    w_true = torch.randn(32, generator=gen)
    x_all = torch.randn(2048, 32, generator=gen) * feature_scales
    y_all = x_all @ w_true + 0.1 * torch.randn(2048, generator=gen)
    return x_all[rank::2], y_all[rank::2], x_all, y_all


def _message_bytes(n: int, world_size: int, block_size: int = BLOCK) -> int:
    chunk = 8 * math.ceil(n / (8 * world_size))
    return chunk // 8 + 4 * math.ceil(chunk / block_size)
