"""Ending a trainer process cleanly, whether it finished or one of its ranks failed.

gloo and NCCL run threads of their own, which may still hold finished work and its tensors. If
the process group is destroyed while DDP's reducer, its communication hook's state or the
optimizer still hold it, the group outlives ``destroy_process_group()`` and is torn down during
the interpreter's finalisation instead, where freeing those tensors (or a still-joinable C++
thread) aborts the process ("terminate called without an active exception"). So the end is ordered: data streams closed, every rank past a barrier (so none tears
down a connection a peer still uses), the holders of the group dropped and collected, and only
then the group destroyed.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["BARRIER_TIMEOUT_S", "exit_with_parent", "shutdown"]

log = logging.getLogger("fuelline.trainer")

# How long a rank that finished waits for its peers at the end. The ranks step in lockstep, so
# healthy peers arrive within seconds; a peer that failed never does, and must not hold the others.
BARRIER_TIMEOUT_S = 60.0


def exit_with_parent(poll_s: float = 0.5) -> threading.Thread:
    """End this process (exit status 1) once the process that started it is gone.

    torchrun starts its ranks in sessions of their own, so a torchrun killed with SIGKILL (an OOM
    killer, ``kill -9``, a node agent) cannot take them with it: they would train on for the rest
    of the run, and write the checkpoints a resumed job writes too. A daemon thread checks every
    ``poll_s`` whether this process was re-parented, which happens when its parent dies.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)  # (polling the parent's pid: nothing signals its death to a non-child)
            if os.getppid() != parent:
                log.error("rank %s: its launcher (pid %d) is gone; stopping (resume with --resume)",
                          os.environ.get("RANK", "?"), parent)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(1)

    thread = threading.Thread(target=watch, name="fl-parent-watch", daemon=True)
    thread.start()
    return thread


def final_barrier(timeout_s: float = BARRIER_TIMEOUT_S) -> bool:
    """Wait, at most ``timeout_s``, until every rank got here; False (logged) if some did not."""
    try:
        if dist.get_backend() == "gloo":
            # Names the ranks that did not arrive, and gives up after the timeout.
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            # NCCL: bounded by the process group's own timeout.
            dist.barrier()
        return True
    except RuntimeError as exc:
        log.error("rank %d: not every rank reached the end (%s); tearing down without them", dist.get_rank(), exc)
        return False


def shutdown(trainer: Any | None, ok: bool, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """End the process's training: close ``trainer``'s streams, meet the other ranks (only if
    this one finished: a failed rank leaves at once, and its peers stop waiting for it after
    ``timeout_s``), drop what holds the process group, collect it, and destroy the group.

    Args:
        trainer: the :class:`~fuelline.trainer.train.Trainer`, or None if building it failed.
        ok: whether this rank finished its work without an error. A failed NCCL rank leaves
            its group to the process's exit: destroying it can block while peers are mid-collective.
        timeout_s: the longest a finished rank waits for the others.
    """
    if trainer is not None:
        try:
            trainer.close()
        except Exception:  # the teardown goes on: the process group must still go
            log.exception("closing the data streams failed")
    if dist.is_initialized() and ok:
        final_barrier(timeout_s)
    if trainer is not None:
        trainer.release()
    gc.collect()  # DDP and its hook's state sit in reference cycles: free them before the group
    # A failed NCCL rank leaves its group alone: destroying it can block while the peers are
    # still inside a collective. A gloo peer just sees the connection close and fails too.
    if dist.is_initialized() and (ok or dist.get_backend() == "gloo"):
        dist.destroy_process_group()
