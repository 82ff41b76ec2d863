"""Who gets a session: the server's caps on sessions, in all and per peer address.

Sessions, threads and memory are bounded by the server's own caps, whatever peers send or claim.
Only once its client has granted credit does a session have batches prepared (up to 2 × hwm
held) and, for a Fuel-style stream, a producer thread; before that it holds a place and nothing
else. So when a cap is reached the server refuses the newcomer (``ErrorCode.BUSY``, naming the
cap) rather than drop a session that works.

A session works while its client keeps granting credit. One that has none left (its client
holds every batch it asked for, or never asked for any) and has granted none for ``grace``
seconds is stalled by its client, and gives its place to a newcomer, the one stalled longest
first: connections that say Hello and read nothing, or read a few batches and then nothing,
cannot lock an honest client out however many they are. A session with credit the server has not
used yet waits on the server (a stage may take seconds a batch), not on its client, and keeps
its place however long that takes. Sessions that never granted credit also give way sooner: to
a newcomer that grants credit at once, whatever their age (the longest stalled going first), so
idle connections cannot hold places against working clients even for the grace; to another idle
newcomer, only once idle for ``grace`` seconds, so idle connections cannot take each other's
places in a loop either. Before anyone is refused or given up, the sessions whose clients are gone make room: a process
killed with its connections open leaves its sessions behind until a send finds the connection
closed or its silence runs out, and a job restarted at once would meet its own ghosts at the caps;
the serving core asks libzmq first (``ServingCore._gone_found``). A session given up is told why (a ``Bye``); its ``ServerDataStream``
reconnects at once, and resumes where it was if it finds a place (a free one, or one stalled in
turn); on a server still full its Hello is refused ``busy`` like any other.

Defaults: 256 sessions, a place per client for a large training job (32 hosts × 8 ranks, or one
host's ranks × DataLoader workers × splits), and far below the thread limits of a host or a
container. Per address, ``(max_clients - 1) // 2``: fewer than half, so no two addresses fill
the server (two leave at least one place free: two of 256 by default), and as much as
that allows to one host, where every process shares an address (on loopback every client does,
and over ipc they all read as ``"local"``): 127 of 256 is 8 ranks × 7 DataLoader workers × 2
splits, or 8 ranks × 15 workers on one split. A host that needs more sets
``--max-clients-per-peer`` (or a larger ``--max-clients``). A quarter would hold one host to 8
ranks × 4 workers × 2 splits and still let four addresses fill the server.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Iterable

if TYPE_CHECKING:  # (the CLI reads the defaults here without loading the serving side)
    from fuelline.server.serving.session import Session

__all__ = ["DEFAULT_MAX_CLIENTS", "Admission", "Verdict", "default_per_peer", "default_max_heartbeat", "peer_of"]

log = logging.getLogger("fuelline.server")

DEFAULT_MAX_CLIENTS = 256
LOCAL = "local"  # the peer of every ipc connection: processes of this host
REFUSALS_LOGGED_EVERY = 10.0  # seconds: a flood of Hellos over a cap is one log line per interval


def default_per_peer(max_clients: int) -> int:
    """Sessions one address may hold unless told otherwise: fewer than half of them, so that no
    two addresses fill the server (from 3 sessions up; at least 1)."""
    return max(1, (max_clients - 1) // 2)


def default_max_heartbeat(heartbeat: float) -> float:
    """The longest heartbeat interval a client may claim: ten of the server's, and at least 30 s
    so that a server with a short interval does not drop clients that keep a longer one."""
    return max(10.0 * heartbeat, 30.0)


def peer_of(frame: Any) -> str:
    """The remote address of the connection a frame (received with ``copy=False``) came in on:
    an IP address over TCP, ``"local"`` over ipc (whose peer address names a process, not a host)."""
    try:
        address = frame.get("Peer-Address")
        ipaddress.ip_address(address)
    except Exception:  # no such property on this transport, or not an IP address
        return LOCAL
    return address


@dataclass(frozen=True)
class Verdict:
    """What to do with a Hello: admit it, after giving up ``evict`` if set; or refuse it."""

    refusal: str | None = None
    evict: Session | None = None


class Admission:
    """The caps, and the choice of which Hello gets a session.

    Args:
        max_clients: most sessions at once.
        max_clients_per_peer: most sessions from one peer address.
        grace: seconds a session with no credit left may go without its client granting any
            before it can be given up for a newcomer when a cap is reached.
    """

    def __init__(self, max_clients: int, max_clients_per_peer: int | None, grace: float) -> None:
        if type(max_clients) is not int or max_clients < 1:
            raise ValueError(f"max_clients must be an int >= 1, got {max_clients!r}")
        per_peer = default_per_peer(max_clients) if max_clients_per_peer is None else max_clients_per_peer
        if type(per_peer) is not int or per_peer < 1:
            raise ValueError(f"max_clients_per_peer must be an int >= 1, got {per_peer!r}")
        self.max_clients = max_clients
        self.max_clients_per_peer = min(per_peer, max_clients)
        self.grace = grace
        self._unlogged = 0
        self._log_at = 0.0

    def admit(self, sessions: Iterable[Session], peer: str, leaving: Collection[Session], now: float,
              grants: bool = True) -> Verdict:
        """Whether a Hello from ``peer`` gets a session. ``leaving``: the sessions it replaces
        (its connection's, its client's), which make room for it; ``grants``: the Hello grants
        credit."""
        staying = [s for s in sessions if s not in leaving]
        mine = [s for s in staying if s.peer == peer]
        if len(mine) >= self.max_clients_per_peer:
            # (Giving up one of this address's own sessions also makes room under the total cap.)
            pool, cap = mine, f"{self.max_clients_per_peer} sessions from {peer} (--max-clients-per-peer)"
        elif len(staying) >= self.max_clients:
            pool, cap = staying, f"{self.max_clients} sessions (--max-clients)"
        else:
            return Verdict()
        stalled = [s for s in pool if s.stalled_for(now) >= self.grace or (grants and not s.granted)]
        if stalled:
            return Verdict(evict=max(stalled, key=lambda s: s.stalled_for(now)))
        return Verdict(refusal=f"server busy: it already serves {cap}; try again later")

    def log_refusal(self, client: str, peer: str, why: str) -> None:
        """Log a refused Hello: the first of a flood, then one line per interval with the count."""
        now = time.monotonic()
        if now < self._log_at:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last line like this)" if self._unlogged else ""
        log.warning("client %s from %s refused: %s%s", client, peer, why, more)
        self._unlogged, self._log_at = 0, now + REFUSALS_LOGGED_EVERY
