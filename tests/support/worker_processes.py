"""Watching worker processes from outside: whether they live, which belong to a server, and the
hand-off files and folders their pools leave in /dev/shm (or the fallback folder)."""

from __future__ import annotations

import os

from fuelline.server.workers import handoff

__all__ = ["TIMEOUT", "alive", "handoff_files", "handoff_folders", "worker_pids"]

TIMEOUT = 60.0


def handoff_folders(pid: int, directory: str | None = None) -> list[str]:
    """Hand-off folders of the serving process ``pid``'s pools (in /dev/shm, or the fallback)."""
    directory = directory or handoff.shm_dir()
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(f"{handoff.PREFIX}{pid}-"))


def handoff_files(pid: int, directory: str | None = None) -> list[str]:
    """Hand-off files of the serving process ``pid``: its pools' task files, not their locks."""
    files = []
    for folder in handoff_folders(pid, directory):
        try:
            files += [os.path.join(folder, n) for n in os.listdir(folder) if n != handoff.LOCK]
        except OSError:
            continue  # (removed meanwhile)
    return sorted(files)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"  # a zombie has exited; only its entry is left


def worker_pids(server_pid: int) -> list[int]:
    """The worker processes of a server: its children started by multiprocessing's spawn."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is None or stat[1] != server_pid or not alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return sorted(pids)
