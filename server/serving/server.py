"""The serving loop: one ROUTER socket, one thread, many client sessions.

The loop alone touches the socket. It drives a ``ServingCore`` (``fuelline.server.serving.core``):
each request it receives goes to the core, which answers, admits and drops; every turn the core
sends what sessions have prepared while their clients have credit and prepares a slice of the
batches of a cooperative source's sessions (``fuelline.server.serving.session``); every quarter
heartbeat it sends heartbeats to clients it has been silent to, and drops clients it has not
heard from for three of their heartbeat intervals. Producer threads, and decodes a session waits
for, wake it through a pipe, so a batch that becomes ready is sent at once, not at the next poll
timeout. Only the loop's own socket failing ends the loop.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any, Callable

import zmq

from fuelline.protocol import DEFAULT_LIMITS, Bye, Limits, encode
from fuelline.protocol.common import descriptors
from fuelline.server.serving.admission import DEFAULT_MAX_CLIENTS, peer_of
from fuelline.server.serving.core import SLOW_STAGE_BEATS, Sent, ServingCore
from fuelline.server.serving.keys import CurveConfig
from fuelline.server.serving.listener import Listener
from fuelline.server.sources.contract import BatchSource

__all__ = ["Server"]

log = logging.getLogger("fuelline.server")

SHUTDOWN_JOIN = 2.0  # seconds all producer threads together get to finish at shutdown
RETRY_FULL = 0.005  # seconds between tries at a full send queue
SPARE_DESCRIPTORS = 64  # open files beyond the clients' connections: shards, pipes, workers, shared memory
DESCRIPTOR_CHECK = 5.0  # seconds between counts of the open files, which warn when they near the limit
DESCRIPTOR_WARN_EVERY = 60.0  # seconds between two such warnings


class Server(Listener, ServingCore):
    """A data server: serves a ``BatchSource`` to any number of clients.

    Args:
        source: what to serve (``ParquetSource``, ``FuelStreamSource``...).
        host: the address to listen on.
        port: the port to listen on; 0 picks a free port (see ``endpoint`` after ``bind``).
        hwm: most batches in flight to one client (and most prepared ahead for it).
        heartbeat: seconds of silence after which the server sends a heartbeat.
        checksum: put an xxh3 checksum of every array in its header.
        limits: hard limits on what the server decodes.
        curve: encrypt, and accept only the clients whose keys it lists
            (``CurveConfig.from_dir(DIR)``); None serves in the clear, which off loopback is
            refused unless ``insecure``.
        status_interval: seconds between status lines in the log; 0 for none.
        local_ipc: also listen on a Unix socket (in a private temporary folder, mode 700: only
            this user's processes reach it) and offer it to clients in their Welcome: one on this
            host moves there, remote ones keep TCP. Not with ``curve``.
        shared_memory: place the batches of clients on the Unix socket in shared memory, where
            they ask for it and the socket folder is in memory: no copy through the socket, no
            checksum (``fuelline.protocol.placement``). A batch that finds no free slab, and every
            batch once a slab cannot be made (/dev/shm full), goes through the socket.
        insecure: serve in the clear off loopback. Without it, a ``host`` other than loopback
            needs ``curve``: an open port would serve the data to anyone who reaches it.
        memory_cache: the last K batches sent to each client are kept (with those prepared ahead
            of them), so a reconnecting client gets them without recomputation
            (``fuelline.server.cache.memory``); 0 keeps none.
        max_clients: most sessions at once; a Hello beyond is refused (``ErrorCode.BUSY``), unless
            a session its client has stalled can make room (``fuelline.server.serving.admission``).
        max_clients_per_peer: most sessions from one peer address (ipc clients share one);
            None: ``(max_clients - 1) // 2``, so that no two addresses fill the server.
        max_client_heartbeat: the longest heartbeat interval a client may claim (a longer one is
            cut to it), so a silent client is dropped within 3 of them; also how long a session
            with no credit left may go without a grant before it can make room for a newcomer.
            None: 10 heartbeats, at least 30 s.
        share_port: listen on ``port`` beside other serving processes of the same user, each
            handed a share of the new connections (``fuelline.server.serving.shared_port``).
    """

    _fatal = (zmq.ZMQError,)  # the loop's own socket failing ends the loop

    def __init__(
        self,
        source: BatchSource,
        *,
        host: str = "127.0.0.1",
        port: int = 5557,
        hwm: int = 10,
        heartbeat: float = 1.0,
        checksum: bool = True,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
        status_interval: float = 0.0,
        memory_cache: int = 10,
        local_ipc: bool = True,
        shared_memory: bool = True,
        insecure: bool = False,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        max_clients_per_peer: int | None = None,
        max_client_heartbeat: float | None = None,
        share_port: bool = False,
    ) -> None:
        ServingCore.__init__(
            self, source, hwm=hwm, heartbeat=heartbeat, checksum=checksum, limits=limits, status_interval=status_interval,
            memory_cache=memory_cache, max_clients=max_clients, max_clients_per_peer=max_clients_per_peer,
            max_client_heartbeat=max_client_heartbeat,
        )
        Listener.__init__(self, host=host, port=port, hwm=hwm, context=context, curve=curve, local_ipc=local_ipc,
                          insecure=insecure, shared_memory=shared_memory, share_port=share_port)

    # -- the loop ------------------------------------------------------------------------------
    def serve_forever(self, ready: Callable[[str], None] | None = None) -> None:
        if self._router is None:
            self.bind()
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_pipe.fd, zmq.POLLIN)
        tick = min(self.heartbeat / 4, 0.25)
        next_tick = time.monotonic() + tick
        self._room_for_clients()
        if ready is not None:
            ready(self.endpoint)  # type: ignore[arg-type]
        # As the last turn left the sessions: one with batches still to prepare leaves no time
        # to wait (a look, and on); a full send queue is looked at again soon (libzmq says
        # nothing when it empties). Anything else that changes rings the loop or is a request.
        busy = blocked = False
        try:
            while self._stop_reason is None:
                timeout = 0.0 if busy else max(0.0, next_tick - time.monotonic())
                if blocked:
                    timeout = min(timeout, RETRY_FULL)
                events = dict(poller.poll(int(timeout * 1000)))
                if router in events:
                    self._drain_requests(router)
                if self._wake_pipe.fd in events:
                    self._wake_pipe.drain()
                busy, blocked = self._turn()
                now = time.monotonic()
                if now >= next_tick:
                    self._keepalive(now)
                    next_tick = now + tick
                    if self.on_turn is not None:
                        self.on_turn()
                    if now >= self._descriptors_at:
                        self._watch_descriptors(now)
                if self._vanished:
                    self._drain_requests(router)
                    busy = True  # (what those requests started is prepared next turn, without a wait)
                    self._drop_vanished()
        finally:
            self._shutdown(self._stop_reason or "server loop ended")

    # -- file descriptors (fuelline.protocol.common.descriptors) ---------------------------------
    _descriptors_at = 0.0  # when the open files are counted next
    _descriptors_warned = float("-inf")

    def _room_for_clients(self) -> None:
        """Raise the limit on open files, as far as the hard limit allows, to what ``max_clients``
        may hold; warn where that is short."""
        per_client = 2 if self.local else 1  # (a client on the Unix socket keeps its TCP connection)
        clients = self.admission.max_clients
        # One more per client: connections that are not sessions (refused busy, not yet said Hello).
        room = descriptors.make_room(SPARE_DESCRIPTORS + (per_client + 1) * clients)
        if room is None:
            return
        if room.raised:
            log.info("raised this process's limit on open files from %d to %d, for up to %d clients (--max-clients)",
                     room.before, room.after, clients)
        if room.short:
            log.warning(
                "%s files are open and this process may open %d (hard limit %d): up to %d clients (--max-clients) may "
                "need %d more. %s; or lower --max-clients",
                "?" if room.open is None else room.open, room.after, room.hard, clients, room.needed, self._past_the_limit())

    def _watch_descriptors(self, now: float) -> None:
        self._descriptors_at = now + DESCRIPTOR_CHECK
        limit, count = descriptors.limits(), descriptors.open_count()
        if limit is None or count is None or count < limit[0] - SPARE_DESCRIPTORS // 4:
            return
        self.stats["open_files_near_limit"] += 1
        if now - self._descriptors_warned >= DESCRIPTOR_WARN_EVERY:
            self._descriptors_warned = now
            log.warning("%d of the %d files this process may open are open (hard limit %d). %s; or lower --max-clients",
                        count, limit[0], limit[1], self._past_the_limit())

    @staticmethod
    def _past_the_limit() -> str:
        return ("Past the limit libzmq cannot accept a connection and retries at once, for ever, spinning a core, "
                "and the clients it never accepted hear nothing: " + descriptors.HOW_TO_RAISE)

    def _drain_requests(self, router: zmq.Socket) -> None:
        for _ in range(1000):  # bounded, so a flood cannot starve sending
            try:
                # Not copied: a request is judged by its header first (fuelline.server.serving.inbound).
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            rid, peer = frames[0].bytes, peer_of(frames[0])
            self._guarded(rid, "handling a request", self._handle, rid, frames[1:], peer, peer=peer)

    def _transmit(self, rid: bytes, frames: list[Any]) -> Sent:
        assert self._router is not None
        try:
            self._router.send_multipart([rid, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return Sent.GONE
            if exc.errno == errno.EAGAIN:
                return Sent.FULL
            raise
        return Sent.OK

    def _shutdown(self, reason: str) -> None:
        bye = encode(Bye(reason))
        for session in list(self.sessions.values()):
            self._send(session.routing_id, bye)
            session.stop()
        # One deadline for all: joined one after another, each with its own timeout, a server
        # with many sessions would take minutes to stop. Those of clients that left already are
        # joined too: a producer still running would meet its source closed under it.
        deadline = time.monotonic() + SHUTDOWN_JOIN
        for session in [*self.sessions.values(), *self._retired]:
            session.join(max(0.0, deadline - time.monotonic()))
        self.sessions.clear()
        self._retired.clear()
        now = time.monotonic()
        for run in self.source.stage_runs():  # (a thread cannot be stopped: its process ends under it)
            took = now - run.started
            log.log(logging.WARNING if took > SLOW_STAGE_BEATS * self.heartbeat else logging.INFO,
                    "stopping without stage %s, abandoned after %.1f s on %s", run.stage, took, run.batch)
        self._close()
        counts = {k: v for k, v in self.counters().items() if v}
        log.info("server stopped: %s; totals: %s", reason, ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
