"""The serving core: admission, sessions, credit, send queues, heartbeats and eviction, without I/O.

``ServingCore`` is told what happened (a request's frames arrived from a connection, a turn came,
time went by, through its clock) and answers through one hook its driver supplies: send these
frames to that connection, which says whether they went, found the peer's queue full, or found
the peer gone. It holds no socket and starts no thread of its own (a session of a source that is
not ``cooperative`` gets a producer thread; a cooperative one's batches are prepared on the
caller's thread, ``_turn``). ``fuelline.server.serving.server.Server`` drives it from one ZeroMQ
ROUTER socket; a simulation (``benchmarks.simulation``) drives a hundred of them on a simulated
network and clock.

Whatever peers send or claim, the server's own caps bound what they cost: sessions in all and per
address (``fuelline.server.serving.admission``), the heartbeat interval a client may claim, the
credit it may grant (``Session.grant``), what the driver's queue to a peer holds (SNDHWM: hwm
batches and a few control messages), and what a request costs before it is refused
(``fuelline.server.serving.inbound``). Anything that goes wrong with one request or one session is
answered, logged with the peer, and the core goes on serving the others.
"""

from __future__ import annotations

import abc
import enum
import logging
import time
import uuid
from collections import deque
from typing import Any, Callable, Mapping

from fuelline.protocol import (
    DEFAULT_LIMITS,
    VERSION,
    Bye,
    Credit,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    ProtocolVersionError,
    Welcome,
    encode,
)
from fuelline.server.cache.memory import RecentBatches
from fuelline.server.serving.admission import DEFAULT_MAX_CLIENTS, LOCAL, Admission, default_max_heartbeat
from fuelline.server.serving.inbound import decode_request
from fuelline.server.serving.session import Session
from fuelline.server.serving.slabs import SessionSlabs
from fuelline.server.serving.status import StatusLine, counters
from fuelline.server.sources.contract import BatchSource

__all__ = ["MAX_WAITING_WELCOMES", "NOT_READING_BEATS", "SLOW_STAGE_BEATS", "Sent", "ServingCore"]

log = logging.getLogger("fuelline.server")

# Heartbeat intervals a peer's send queue may stay full, with items waiting to go to it, before
# it is dropped as not reading. A queue fills for a moment where a Hello replaced a session whose
# batches are still on their way, and the new one's follow them.
NOT_READING_BEATS = 3
# Bytes of Welcomes a connection may have waiting for room in its send queue (each Hello on it is
# answered, however fast they come): about 1,700 of a Parquet source's, 64 of the largest.
MAX_WAITING_WELCOMES = 2**20
# Seconds the loop prepares one session's batches before it turns to the next session and its
# requests (a gather of several batches at once may run past it: 10-20 ms of 4 MB).
PREPARE_SLICE = 0.005
# Seconds between probes for sessions whose peers are gone, made when a Hello meets a cap.
GONE_PROBE_EVERY = 0.1
# Heartbeat intervals a batch may spend in a user's stage before the server warns (once a stage).
SLOW_STAGE_BEATS = 3


class Sent(enum.Enum):
    """What became of frames handed to the driver: sent, the peer's queue full, the peer gone."""

    OK = "ok"
    FULL = "full"
    GONE = "gone"


class ServingCore(abc.ABC):
    """Serves a ``BatchSource`` to any number of connections (see ``Server`` for the arguments).

    Args:
        clock: the time, in seconds (``time.monotonic``; a simulation's own).
    """

    hwm: int
    # The server's Unix socket and its token, offered to clients in their Welcome; the folder
    # where local clients' batches may be placed in shared memory. None until a driver binds them.
    local: dict[str, str] | None = None
    slab_folder: str | None = None
    # Exceptions that are the driver's own failing (its socket): they end the loop, not a request.
    _fatal: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        source: BatchSource,
        *,
        hwm: int = 10,
        heartbeat: float = 1.0,
        checksum: bool = True,
        limits: Limits = DEFAULT_LIMITS,
        status_interval: float = 0.0,
        memory_cache: int = 10,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        max_clients_per_peer: int | None = None,
        max_client_heartbeat: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1, got {hwm}")
        if not 0 < heartbeat <= 3600:
            raise ValueError(f"heartbeat must be in (0, 3600] seconds, got {heartbeat}")
        if max_client_heartbeat is None:
            max_client_heartbeat = default_max_heartbeat(heartbeat)
        if not 0 < max_client_heartbeat <= 3600:
            raise ValueError(f"max_client_heartbeat must be in (0, 3600] seconds, got {max_client_heartbeat}")
        self._clock = clock
        self.hwm = hwm
        self.max_client_heartbeat = max_client_heartbeat
        self.admission = Admission(max_clients, max_clients_per_peer, grace=max_client_heartbeat)
        self.source = source
        self.heartbeat = heartbeat
        self.checksum = checksum
        self.limits = limits
        self.sessions: dict[bytes, Session] = {}
        # Which Unix socket a Hello over TCP is offered (``fuelline.server.serving.local_group``):
        # another serving process's, in turn; None: this server's own.
        self.local_offer: Callable[[Mapping[str, str]], Mapping[str, str]] | None = None
        # Called at every turn of the serving loop, at least every quarter heartbeat (a supervisor
        # hears from it that this process still serves).
        self.on_turn: Callable[[], None] | None = None
        # How many serving processes share this one's port (``--processes``): told to clients in
        # the Welcome's info, so that a reader with fewer connections can say so.
        self.serving_processes = 1
        # Sessions whose peer was gone when a send reached it: dropped once what it sent last
        # (a Bye, say, queued before its connection closed) has been read.
        self._vanished: dict[bytes, Session] = {}
        # Dropped sessions whose producer thread may still be finishing a batch: shutdown waits
        # for them too, before the source they read from is closed.
        self._retired: list[Session] = []
        # The memory tier: the last K batches sent to each client, plus the up to hwm prepared
        # ahead of them (held anyway), so a client that lost its in-flight batches gets them again.
        self.recent = RecentBatches(memory_cache + hwm) if memory_cache else None
        self.stats = {"malformed": 0, "dropped_silent": 0, "sessions": 0, "batches": 0, "bytes": 0, "refused_busy": 0,
                      "errors": 0, "batches_shared": 0, "open_files_near_limit": 0}
        self.status_interval = status_interval  # seconds between status lines in the log; 0: none
        self._status = StatusLine(status_interval, self._clock())
        self._slow_stages: set[str] = set()  # stages already warned about
        # Sessions that may have something to send or prepare, looked at next turn (in order);
        # and those rung from other threads since the last turn.
        self._active: dict[bytes, None] = {}
        self._rung: deque[bytes] = deque()
        self._probed_at = float("-inf")  # when sessions were last probed for peers gone (_gone_found)

    # -- what the driver supplies ----------------------------------------------------------------
    @abc.abstractmethod
    def _transmit(self, rid: bytes, frames: list[Any]) -> Sent:
        """Send one message's frames to connection ``rid``, never waiting."""

    def _wake(self) -> None:  # noqa: B027 (optional: a driver that polls leaves it)
        """Ring the driver: a session has something to send, or a decode it waited for is done
        (called from any thread)."""

    # -- a turn --------------------------------------------------------------------------------
    def _turn(self) -> tuple[bool, bool]:
        """Send what sessions may send, and prepare a slice of inline sessions' batches: the
        sessions that may have something to do (``_active``), not every session, so that a turn
        costs what is done in it, not how many clients are connected. Returns (busy: a session
        has batches it could prepare now; blocked: a peer's queue is full)."""
        rung = self._rung
        while rung:  # (sessions rung from other threads: a producer's batch, a decode done)
            self._active[rung.popleft()] = None
        active, self._active = self._active, {}
        busy = blocked = False
        for rid in active:
            session = self.sessions.get(rid)
            if session is None:
                continue
            if session.sendable:
                self._guarded(rid, "sending", self._flush, session)
            if session.can_advance:
                self._guarded(rid, "preparing a batch", self._prepare, session)
            if session.can_advance or session.blocked_since is not None:
                self._active[rid] = None  # (again next turn)
                busy = busy or session.can_advance
                blocked = blocked or session.blocked_since is not None
        return busy, blocked

    def _ring(self, rid: bytes) -> None:
        """A session has something to do (from any thread): a look at it next turn, and the driver rung."""
        self._rung.append(rid)
        self._wake()

    def _drop_vanished(self) -> None:
        """Drop the sessions whose peers were found gone (after what they sent last was read)."""
        for rid, session in self._vanished.items():
            if self.sessions.get(rid) is session:
                self._drop(session, "disconnected")
        self._vanished.clear()

    def _guarded(self, rid: bytes, doing: str, step: Callable[..., None], *args: Any, peer: str = LOCAL) -> None:
        """One request (from ``peer``) or one session's turn: whatever it raises (a bug,
        MemoryError) is logged with the peer and answered, its session ends, and the loop serves
        the others. Only what the driver names fatal (its own socket failing) ends the loop."""
        try:
            step(*args)
        except self._fatal:
            raise
        except Exception as exc:
            self.stats["errors"] += 1
            session = self.sessions.get(rid)
            try:
                peer = session.peer if session is not None else peer
                who = f"client {session.name}" if session is not None else f"connection {rid.hex()}"
                log.error("%s from %s: %s failed", who, peer, doing, exc_info=True)
                if session is not None:
                    self._drop(session, f"{doing} failed ({type(exc).__name__})")
                self._reply(rid, ErrorCode.INTERNAL, f"the server failed {doing}: {type(exc).__name__}: {exc}"[:1000])
            except self._fatal:
                raise
            except Exception:  # (MemoryError again, say): the next request may fare better
                pass

    def _send(self, rid: bytes, frames: list[Any], drop_if_full: bool = True) -> bool:
        sent = self._transmit(rid, frames)
        session = self.sessions.get(rid)
        if sent is Sent.GONE:
            if session is not None:
                self._vanished[rid] = session
            return False
        if sent is Sent.FULL:
            if session is not None and drop_if_full:
                self._drop(session, "not reading")
            return False
        if session is not None:
            session.last_sent = self._clock()
        return True

    def _reply(self, rid: bytes, code: str, message: str, fatal: bool = True) -> None:
        self._send(rid, encode(Error(code, message, fatal)))

    def _handle(self, rid: bytes, body: list[Any], peer: str = LOCAL) -> None:
        """A request's frames (``zmq.Frame`` or bytes), from connection ``rid`` at ``peer``."""
        try:
            msg = decode_request(body, self.limits)
        except ProtocolVersionError as exc:
            self.stats["malformed"] += 1
            self._reply(rid, ErrorCode.VERSION, f"this server speaks fuelline protocol version {VERSION}, the client sent version {exc.got!r}")
            return
        except ProtocolError as exc:
            self.stats["malformed"] += 1
            log.debug("malformed message from %s: %s", rid.hex(), exc)
            self._reply(rid, ErrorCode.MALFORMED, f"malformed message: {exc}")
            return
        session = self.sessions.get(rid)
        if session is not None:
            session.last_heard = self._clock()
        if isinstance(msg, Hello):
            self._hello(rid, msg, peer)
        elif isinstance(msg, (Credit, Heartbeat)):
            if session is None:
                self._reply(rid, ErrorCode.NO_SESSION, "no session for this connection; send Hello", fatal=False)
            else:
                self._granting(session, msg)
        elif isinstance(msg, Bye):
            if session is not None:
                self._drop(session, f"said bye ({msg.reason})" if msg.reason else "said bye", level=logging.INFO)
                if self.recent is not None:
                    self.recent.forget(session.hello.client_id)  # it will not come back for them
        else:
            self._reply(rid, ErrorCode.BAD_REQUEST, f"a client may not send {msg.TYPE} messages")

    def _granting(self, session: Session, msg: Credit | Heartbeat) -> None:
        """A Credit, or a heartbeat that says how much credit its client granted in all."""
        if isinstance(msg, Credit):
            session.release(msg.released)
            if msg.n:
                self._credit(session, msg.n)
        elif msg.sent is not None and msg.stream == session.hello.stream:
            lost = session.credit_lost(msg.sent)
            if lost:
                log.warning("client %s: credit for %d batches lost in transit; made good", session.name, lost)
                self._credit(session, lost)

    def _credit(self, session: Session, n: int) -> None:
        try:
            session.grant(n)
        except ProtocolError as exc:
            self._drop(session, f"a credit no client could grant, from {session.peer}: {exc}")
            self._reply(session.routing_id, ErrorCode.BAD_REQUEST, f"refused: {exc}")
            return
        if self._start(session):
            self._flush(session)

    def _start(self, session: Session) -> bool:
        """Start the session's producer once its client has granted credit; a process out of
        threads refuses this session (busy) and goes on serving the others."""
        try:
            session.start()
        except RuntimeError as exc:  # "can't start new thread"
            self.stats["refused_busy"] += 1
            self._drop(session, f"no thread for it ({exc}), from {session.peer}")
            self._reply(session.routing_id, ErrorCode.BUSY, f"server busy: it cannot start another thread ({exc})")
            return False
        return True

    def _hello(self, rid: bytes, hello: Hello, peer: str = LOCAL) -> None:
        """Answer a Hello: refuse what is not served or has no room, else replace the session
        this routing id (and its twins, the same client id) had, and welcome a new one."""
        wanted = self._served_or_refused(rid, hello)
        if wanted is None:
            return
        old = self.sessions.get(rid)
        twins = [s for s in self.sessions.values() if s.hello.client_id == hello.client_id and s is not old]
        if not self._admitted(rid, hello, peer, [*twins, old] if old else twins):
            return
        old = self.sessions.pop(rid, None)
        # A Welcome the session this Hello replaces could not send yet (its peer's queue full)
        # still goes, first: every Hello is answered. A peer that does not read cannot pile them up.
        carried = old.unsent_welcomes() if old is not None else []
        if old is not None and not self._stop_replaced(old, carried):
            return
        self._drop_twins(twins, peer)
        session = self._new_session(rid, hello, wanted, peer)
        # Before the Welcome: a session the server has no thread for is refused, not welcomed.
        if not self._start(session):
            return
        # Queued ahead of its batches: it waits with them where the peer's queue is full (of the
        # batches of a session this Hello replaced, say).
        session.put_first(*carried, ("welcome", encode(self._welcome(session.name, hello, wanted, peer)), 0))
        session.blocked_since = old.blocked_since if old is not None else None
        self._flush(session)
        if old is None and self.sessions.get(rid) is session:
            log.info(
                "client %s: rank %d of %d, split %r, from epoch %d batch %d",
                session.name, hello.rank, hello.world_size, hello.split, hello.epoch, hello.cursor,
            )

    def _served_or_refused(self, rid: bytes, hello: Hello) -> tuple[str, ...] | None:
        """The sources a Hello asks for, or None once it is told its split or a source is not served."""
        src = self.source
        if hello.split not in src.splits:
            self._reply(rid, ErrorCode.UNKNOWN_SPLIT, f"split {hello.split!r} is not served here; this server has splits {list(src.splits)}")
            return None
        wanted = hello.sources if hello.sources is not None else src.sources
        for name in wanted:
            if name not in src.sources:
                why = src.why_not_servable(name)
                detail = why if why else f"this server has sources {list(src.sources)}"
                self._reply(rid, ErrorCode.UNKNOWN_SOURCE, f"cannot serve source {name!r}: {detail}")
                return None
        return tuple(wanted)

    def _admitted(self, rid: bytes, hello: Hello, peer: str, replaced: list[Session]) -> bool:
        """Admission: False once a Hello is refused busy; evicts the stalled session the
        admission names to make room."""
        now = self._clock()
        verdict = self.admission.admit(self.sessions.values(), peer, replaced, now, grants=hello.credit > 0)
        if (verdict.refusal is not None or verdict.evict is not None) and self._gone_found(now, replaced):
            verdict = self.admission.admit(self.sessions.values(), peer, replaced, now, grants=hello.credit > 0)
        if verdict.refusal is not None:
            self.stats["refused_busy"] += 1
            self.admission.log_refusal(hello.client_id[:12], peer, verdict.refusal)
            self._reply(rid, ErrorCode.BUSY, verdict.refusal)
            return False
        if verdict.evict is not None:
            gone = verdict.evict
            why = f"granted no credit in {gone.stalled_for(now):.1f}s" + (" and has none left" if gone.granted else "")
            self._drop(gone, f"{why}; its place went to a new client", logging.INFO)
            self._send(gone.routing_id, encode(Bye(f"server full, and this session {why}")))
        return True

    def _gone_found(self, now: float, keep: list[Session]) -> bool:
        """At a cap, before anyone is refused or given up: drop the sessions whose peers are gone
        (True if any). A process killed with its connections open leaves its sessions behind until
        a send finds its peer gone (its next heartbeat, up to an interval away) or its silence
        runs out (3 of its intervals); a job restarted at once would meet its own ghosts at the
        caps. A heartbeat to every session finds them now: libzmq knows a closed connection. At
        most once per ``GONE_PROBE_EVERY`` seconds, so a flood of Hellos at a cap costs little."""
        if now < self._probed_at + GONE_PROBE_EVERY:
            return False
        self._probed_at = now
        for session in list(self.sessions.values()):
            if session not in keep:
                beat = Heartbeat(stream=session.hello.stream, sent=session.sent_items)
                self._send(session.routing_id, encode(beat), drop_if_full=False)
        found = bool(self._vanished)
        self._drop_vanished()
        return found

    def _stop_replaced(self, old: Session, carried: list) -> bool:
        """Stop a session a Hello replaces; False (and it is dropped) where the Welcomes it could
        not send are more than a peer that reads would leave waiting."""
        old.stop()
        waiting = sum(memoryview(f).nbytes for _, frames, _ in carried for f in frames)
        if waiting > MAX_WAITING_WELCOMES:
            self._drop(old, f"not reading: {len(carried)} Welcomes ({waiting} bytes) waiting for room in its send queue")
            return False
        return True

    def _drop_twins(self, twins: list[Session], peer: str) -> None:
        """Drop the sessions of the same client id that a new connection of it replaces."""
        for other in twins:
            # A client on this host moves to the Unix socket once welcomed over TCP: routine, not news.
            if peer == LOCAL and other.peer != LOCAL:
                self._drop(other, "moved to this host's Unix socket", level=logging.DEBUG)
            else:
                self._drop(other, "replaced by a new connection of the same client", level=logging.INFO)

    def _new_session(self, rid: bytes, hello: Hello, wanted: tuple[str, ...], peer: str) -> Session:
        tag = uuid.uuid4().hex
        name = f"{hello.client_id[:12]}#{tag[:6]}"
        slabs = None
        if hello.shm and peer == LOCAL and self.slab_folder is not None:
            # Prepared, in flight, and a few the client still holds or has not yet said it let go.
            slabs = SessionSlabs(self.slab_folder, tag, max_slabs=3 * self.hwm + 8)
        session = Session(rid, hello, self.source, wanted, self.hwm, self.checksum, lambda: self._ring(rid), name, self.recent,
                          peer=peer, max_heartbeat=self.max_client_heartbeat, slabs=slabs, clock=self._clock)
        self.sessions[rid] = session
        self.stats["sessions"] += 1
        return session

    def _welcome(self, name: str, hello: Hello, wanted: tuple[str, ...], peer: str) -> Welcome:
        src = self.source
        schema = src.schema()
        return Welcome(
            session=name,
            stream=hello.stream,
            sources=wanted,
            schema={k: schema[k] for k in wanted},
            batches_per_epoch=src.batches_per_epoch(hello.split, hello.rank, hello.world_size),
            heartbeat=self.heartbeat,
            info={**src.info(hello.split), **({"serving_processes": self.serving_processes}
                                              if self.serving_processes > 1 else {})},
            local=self.local if peer == LOCAL or self.local is None or self.local_offer is None
            else self.local_offer(self.local),
            # A source without one (a Fuel-style stream) leaves its clients nothing to hold to.
            fingerprint=src.fingerprint(hello.split),
        )

    def _flush(self, session: Session) -> None:
        try:
            items = session.take_sendable()
            for i, (kind, frames, nbytes) in enumerate(items):
                if not self._send(session.routing_id, frames, drop_if_full=False):
                    # Full (or the peer is gone, and the session goes at the end of this turn): the
                    # rest waits, and a queue that stays full is a peer not reading (_keepalive).
                    session.requeue(items[i:])
                    if session.blocked_since is None:
                        session.blocked_since = self._clock()
                    return
                session.blocked_since = None
                if kind in ("batch", "end"):
                    session.sent_items += 1  # (heartbeats tell the client, which counts what arrived)
                if kind == "batch":
                    self.stats["batches"] += 1
                    self.stats["bytes"] += nbytes
                    if len(frames) == 1 and nbytes:
                        self.stats["batches_shared"] += 1
        finally:
            if session.can_advance or session.blocked_since is not None:
                self._active[session.routing_id] = None  # (more to do: a look next turn)

    def _prepare(self, session: Session) -> None:
        """A slice of an inline session's batches, sent as far as its credit goes."""
        session.advance(self._clock() + PREPARE_SLICE)
        self._flush(session)

    def counters(self) -> dict[str, int]:
        """Everything counted so far: batches and bytes sent, sessions, the cache tiers' hits and
        misses, the source's own events (worker restarts, remote fetches...)."""
        return counters(self)

    def _keepalive(self, now: float) -> None:
        if self._status.due(now):
            self._status.log(self, now)
        self._watch_stages(now)
        for session in list(self.sessions.values()):
            if now - session.last_heard > 3 * session.client_heartbeat:
                self.stats["dropped_silent"] += 1
                self._drop(session, f"silent for {now - session.last_heard:.1f}s (3 heartbeat intervals)")
            elif session.blocked_since is not None and now - session.blocked_since > NOT_READING_BEATS * self.heartbeat:
                self._drop(session, f"not reading: its send queue full for {now - session.blocked_since:.1f}s")
            elif now - session.last_sent >= self.heartbeat:
                # A heartbeat that finds the peer's queue full is not sent, and costs nothing:
                # the peer has plenty to read, and its own silence, not ours, decides its fate.
                beat = Heartbeat(stream=session.hello.stream, sent=session.sent_items)
                self._send(session.routing_id, encode(beat), drop_if_full=False)

    def _watch_stages(self, now: float) -> None:
        """Warn, once a stage, of a batch that has been in a user's stage for over a few heartbeats."""
        for run in self.source.stage_runs():  # (longest running first)
            took = now - run.started
            if took <= SLOW_STAGE_BEATS * self.heartbeat:
                return
            if run.stage in self._slow_stages:
                continue
            self._slow_stages.add(run.stage)
            log.warning(
                "stage %s has been running for %.1f s on %s (over %d heartbeats): that batch's client waits for it "
                "(heartbeats keep it connected) and the other clients are served meanwhile. The status lines and "
                "fuelline_stage_seconds say how long each stage takes a batch", run.stage, took, run.batch, SLOW_STAGE_BEATS,
            )

    def _drop(self, session: Session, why: str, level: int = logging.WARNING) -> None:
        if self.sessions.get(session.routing_id) is session:
            del self.sessions[session.routing_id]
        session.stop()
        self._retired = [s for s in self._retired if s.producer_alive]
        if session.producer_alive:
            self._retired.append(session)
        log.log(level, "client %s dropped: %s; its buffers are freed", session.name, why)
