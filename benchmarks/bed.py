"""A bed of hosts and links on one machine, for tests and benchmarks that need a network.

Each host is a Linux network namespace with one interface, ``eth0``, and its own address on a
private /24. The hosts meet on a bridge that lives in a namespace of its own (the switch), so
the machine's own namespace, routes and firewall are never touched. Every link can be
rate-limited (``tc`` tbf, both directions: the host's egress and the switch's egress towards
it), taken down and brought back (a real partition: packets are dropped, connections see
silence, not a reset), and a host can be confined to CPUs (``taskset``)::

    with Bed(3, rate="1gbit", cpus=["0", "1", "1"]) as bed:
        server = subprocess.Popen(bed.hosts[0].command(["fuelline", "serve", ..., "--host", bed.hosts[0].address]))
        bed.hosts[1].address          # '10.213.7.2'
        bed.partition(1)              # host 1 loses its link; bed.heal(1) brings it back

It needs root (``ip netns``), as CI has; :func:`unavailable` says why not, for a skip. Everything
a bed made (namespaces, links, the bridge, and any process left in its namespaces) is removed
when it closes, and at interpreter exit if it was never closed. Only addresses inside the bed are
used: nothing leaves the machine.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Bed", "Host", "check_rate", "unavailable"]

_COMMAND_TIMEOUT_S = 30
_counter = itertools.count()
_lock = threading.Lock()
_open: set["Bed"] = set()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if check and done.returncode:
        raise RuntimeError(f"bed: {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why a bed cannot be built here (a skip reason), or None if it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the bed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the bed needs root (ip netns, tc)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"),
                          ("nsenter", "util-linux"), ("taskset", "util-linux")):
        if shutil.which(tool) is None:
            return f"the bed needs the {tool!r} command ({package})"
    probe = f"flprobe{os.getpid() % 100000}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "delete", probe, check=False)
    return None


@dataclass
class Host:
    """One host of a bed: its namespaces, address and CPUs.

    A host is a network namespace and a mount namespace with a ``/dev/shm`` of its own, held by a
    process that sleeps there: processes of one host share memory files and Unix sockets, as on
    a machine, and processes of two hosts do not (a data server's local socket and shared memory
    are not reachable from another host, as they would not be off this machine). ``TMPDIR``
    points there too. The file system is otherwise the machine's, so data and results are
    exchanged through files as usual.
    """

    bed_tag: str
    index: int
    namespace: str
    address: str
    cpus: str | None
    switch_port: str  # its link's end on the switch
    holder: subprocess.Popen[str] | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: in its namespaces, on its CPUs, with ``TMPDIR`` on its own
        memory file system and gloo and NCCL on its ``eth0``."""
        if self.holder is None:
            raise RuntimeError("bed: the bed is not started")
        # --wd=.: the caller's working directory, opened before entering (entering a mount
        # namespace moves a process to its root).
        prefix = ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--wd=.", "--",
                  "env", "TMPDIR=/dev/shm", "GLOO_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=eth0",
                  "TP_SOCKET_IFNAME=eth0"]
        if self.cpus is not None:
            prefix += ["taskset", "-c", self.cpus]
        return [*prefix, *argv]


_HOLD = "mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && echo ready && exec sleep infinity"


class Bed:
    """``hosts`` hosts on a switch; ``rate`` (tc's units: ``100mbit``, ``1gbit``) limits every
    link, ``cpus`` gives each host a CPU list for ``taskset`` (``"0"``, ``"0-1"``; None: any)."""

    def __init__(self, hosts: int, rate: str | None = None, cpus: Sequence[str | None] | None = None) -> None:
        if hosts < 1 or hosts > 250:
            raise ValueError(f"a bed has 1 to 250 hosts, got {hosts}")
        if rate is not None:
            check_rate(rate)
        if cpus is not None and len(cpus) != hosts:
            raise ValueError(f"cpus names {len(cpus)} hosts, the bed has {hosts}")
        with _lock:
            number = next(_counter)
        # Interface names are at most 15 characters: keep the tag short and unique per process.
        self.tag = f"{os.getpid() % 100000:05d}{number % 100:02d}"
        self.rate = rate
        self.switch = f"fl{self.tag}sw"
        self.bridge = "br0"
        subnet = self._free_subnet()
        self.hosts = [
            Host(self.tag, i, f"fl{self.tag}h{i}", f"{subnet}.{i + 1}", None if cpus is None else cpus[i],
                 f"s{self.tag}h{i}")
            for i in range(hosts)
        ]
        self._made: list[str] = []
        self._closed = False

    # -- building and removing ---------------------------------------------------------------
    @staticmethod
    def _free_subnet() -> str:
        used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
        for name in _run("ip", "netns", "list", check=False).stdout.split():
            if name.startswith("fl"):
                used += _run("ip", "-n", name, "-o", "-4", "addr", "show", check=False).stdout
        for third in range((os.getpid() % 200) + 20, 256):
            subnet = f"10.213.{third}"
            if f" {subnet}." not in used:
                return subnet
        raise RuntimeError("bed: no free 10.213.x.0/24 subnet")

    def __enter__(self) -> "Bed":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        with _lock:
            _open.add(self)
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", self.bridge, "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.namespace)
            self._made.append(host.namespace)
            # The pair is made in the switch and one end moved to the host, named eth0 there.
            _run("ip", "-n", self.switch, "link", "add", host.switch_port, "type", "veth", "peer", "name",
                 f"p{self.tag}h{host.index}")
            _run("ip", "-n", self.switch, "link", "set", f"p{self.tag}h{host.index}", "netns", host.namespace)
            _run("ip", "-n", host.namespace, "link", "set", f"p{self.tag}h{host.index}", "name", "eth0")
            _run("ip", "-n", self.switch, "link", "set", host.switch_port, "master", self.bridge)
            _run("ip", "-n", self.switch, "link", "set", host.switch_port, "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
            if self.rate is not None:
                self.limit(host.index, self.rate)
            host.holder = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--propagation", "private", "--",
                 "sh", "-c", _HOLD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert host.holder.stdout is not None
            if host.holder.stdout.readline().strip() != "ready":
                raise RuntimeError(f"bed: host {host.index} got no /dev/shm of its own: "
                                   f"{host.holder.stderr.read() if host.holder.stderr else ''}")

    def limit(self, index: int, rate: str) -> None:
        """Limit host ``index``'s link to ``rate`` both ways (replacing any earlier limit)."""
        host = self.hosts[index]
        burst = _burst_bytes(rate)
        for namespace, device in ((host.namespace, "eth0"), (self.switch, host.switch_port)):
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                 "rate", rate, "burst", str(burst), "latency", "100ms")

    def partition(self, index: int) -> None:
        """Cut host ``index``'s link: nothing gets through either way until :meth:`heal`."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[index].switch_port, "down")

    def heal(self, index: int) -> None:
        """Bring host ``index``'s link back after :meth:`partition`."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[index].switch_port, "up")

    def close(self) -> None:
        """Kill what still runs in the bed's namespaces, then remove them (and so every link)."""
        if self._closed:
            return
        self._closed = True
        for namespace in reversed(self._made):
            _kill_all_in(namespace)
            _run("ip", "netns", "delete", namespace, check=False)
        for host in self.hosts:
            if host.holder is not None:
                for pipe in (host.holder.stdout, host.holder.stderr):
                    if pipe is not None:
                        pipe.close()
                if host.holder.poll() is None:
                    host.holder.kill()
                host.holder.wait(timeout=_COMMAND_TIMEOUT_S)
        with _lock:
            _open.discard(self)


def check_rate(rate: str) -> None:
    """Raise ValueError unless ``rate`` is a rate tc understands here (``100mbit``, ``1gbit``...)."""
    _burst_bytes(rate)


def _burst_bytes(rate: str) -> int:
    """A token bucket of 2 ms at ``rate`` (at least 64 KiB): enough for full-sized segments at
    any rate, small enough that the rate holds over a few milliseconds."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = rate.strip().lower()
    for suffix, factor in units.items():
        if text.endswith(suffix):
            try:
                bits_per_s = float(text[: -len(suffix)]) * factor
            except ValueError:
                break
            if bits_per_s <= 0:
                break
            return max(64 * 1024, int(bits_per_s / 8 * 0.002))
    raise ValueError(f"bed: a rate is a number with kbit, mbit or gbit, got {rate!r}")


def _kill_all_in(namespace: str) -> None:
    pids = [int(p) for p in _run("ip", "netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", namespace, check=False).stdout.split()]
        if pids:
            time.sleep(0.05)  # waiting for the kernel to reap what was just killed; bounded


@atexit.register
def _close_all() -> None:
    for bed in list(_open):
        bed.close()
