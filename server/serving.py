"""The serving loop: one ROUTER socket, one thread, many client sessions.

The loop alone touches the socket. It answers requests, sends what sessions have prepared while
their clients have credit, sends heartbeats to clients it has been silent to, and drops clients
it has not heard from for three of their heartbeat intervals. Producer threads wake it through a
pipe, so a batch that becomes ready is sent at once, not at the next poll timeout.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
import uuid
from typing import Any, Callable

import zmq

from fuelline.protocol import (
    DEFAULT_LIMITS,
    VERSION,
    Bye,
    Credit,
    DataError,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    ProtocolVersionError,
    Welcome,
    decode,
    encode,
)
from fuelline.server.keys import CurveConfig, is_loopback, start_authenticator
from fuelline.server.local_ipc import LocalSocketDir
from fuelline.server.recent import RecentBatches
from fuelline.server.session import Session
from fuelline.server.sources import BatchSource

__all__ = ["Server"]

log = logging.getLogger("fuelline.server")

# Clients send only small control messages: libzmq disconnects a peer whose frame is bigger. It
# caps each frame, not a whole multipart message (libzmq has no such option), so a hostile peer can
# still make the server hold many frames; off loopback, CURVE keeps strangers out altogether.
MAX_INBOUND_BYTES = 1 << 20


class Server:
    """A data server: serves a ``BatchSource`` to any number of clients.

    Args:
        source: what to serve (``ParquetSource``, ``FuelStreamSource``...).
        host, port: where to listen; port 0 picks a free port (see ``endpoint`` after ``bind``).
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
        insecure: serve in the clear off loopback. Without it, a ``host`` other than loopback
            needs ``curve``: an open port would serve the data to anyone who reaches it.
        memory_cache: the last K batches sent to each client are kept (with those prepared ahead
            of them), so a reconnecting client gets them without recomputation
            (``fuelline.server.recent``); 0 keeps none.
    """

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
        insecure: bool = False,
    ) -> None:
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1, got {hwm}")
        if not 0 < heartbeat <= 3600:
            raise ValueError(f"heartbeat must be in (0, 3600] seconds, got {heartbeat}")
        self.source = source
        self.host = host
        self.port = port
        self.hwm = hwm
        self.heartbeat = heartbeat
        self.checksum = checksum
        self.limits = limits
        self.curve = curve
        if curve is None and not insecure and not is_loopback(host):
            raise DataError(
                f"refusing to serve on {host} without CURVE: anyone who can reach the port could read the data. "
                "Create keys with `fuelline keygen DIR` and pass curve=CurveConfig.from_dir(DIR), or "
                "insecure=True for a network that is private by other means"
            )
        self._auth: Any = None  # the ZAP authenticator thread, while CURVE is on
        self.sessions: dict[bytes, Session] = {}
        self.local_ipc = local_ipc
        self.local: dict[str, str] | None = None  # the ipc endpoint and its token, once bound
        self._ipc_dir: LocalSocketDir | None = None
        # The memory tier: the last K batches sent to each client, plus the up to hwm prepared
        # ahead of them (held anyway), so a client that lost its in-flight batches gets them again.
        self.recent = RecentBatches(memory_cache + hwm) if memory_cache else None
        self.endpoint: str | None = None
        # A context of its own, terminated at shutdown: that waits (up to the linger) until
        # libzmq has sent or dropped every zero-copy frame, before their memory can go away.
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._router: zmq.Socket | None = None
        self._stop_reason: str | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_closed = False
        self._wake_pending = False
        self._thread: threading.Thread | None = None
        self.stats = {"malformed": 0, "dropped_silent": 0, "sessions": 0, "batches": 0, "bytes": 0}
        self.status_interval = status_interval  # seconds between status lines in the log; 0: none
        self._status_at = time.monotonic() + status_interval
        self._status_base = (0, 0, time.monotonic())

    # -- lifecycle -----------------------------------------------------------------------------
    def bind(self) -> str:
        """Bind the socket; returns ``tcp://host:port`` with the port actually bound."""
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises instead of a silent drop
        router.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        router.setsockopt(zmq.LINGER, 1000)
        address = f"[{self.host}]" if ":" in self.host else self.host
        if ":" in self.host:
            router.setsockopt(zmq.IPV6, 1)
        try:
            self._secure(router)
            if self.port == 0:
                self.port = router.bind_to_random_port(f"tcp://{address}")
            else:
                router.bind(f"tcp://{address}:{self.port}")
            if self.local_ipc and self.curve is None:
                # (With CURVE every connection stays on it: the server's keys decide who reads.)
                self._bind_local(router)
        except BaseException:
            router.close(linger=0)
            self._stop_auth()
            self._remove_local()
            raise
        self._router = router
        self.endpoint = f"tcp://{address}:{self.port}"
        return self.endpoint

    def _bind_local(self, router: zmq.Socket) -> None:
        """The Unix socket that clients on this host move to, with the token that proves it."""
        self._ipc_dir = LocalSocketDir()  # (sweeps the folders of servers killed before they could)
        path = self._ipc_dir.socket_path
        router.bind(f"ipc://{path}")
        token = secrets.token_hex(16)
        with open(path + ".token", "w") as f:
            f.write(token)
        self.local = {"endpoint": f"ipc://{path}", "token": token}

    def _remove_local(self) -> None:
        if self._ipc_dir is not None:
            self._ipc_dir.remove()
            self._ipc_dir = None

    def _secure(self, router: zmq.Socket) -> None:
        """CURVE on the socket (before bind), or a warning where the clear text can leave the machine."""
        if self.curve is None:
            if not is_loopback(self.host):  # (only when asked for: see insecure in __init__)
                log.warning(
                    "serving on %s without encryption or authentication (insecure): anyone who can reach "
                    "this port can read the data",
                    self.host,
                )
            return
        # The authenticator must answer before the first client connects: without a ZAP
        # handler, libzmq lets every CURVE client in.
        self._auth = start_authenticator(self._ctx, self.curve)
        router.curve_secretkey = self.curve.secret_key
        router.curve_publickey = self.curve.public_key
        router.curve_server = True

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()  # closes its sockets: the context cannot terminate before this
            self._auth = None

    def stop(self, reason: str = "server shutting down") -> None:
        """Ask the loop to say Bye to every client and return. Safe from signal handlers and threads."""
        self._stop_reason = reason
        self._wake()

    def start(self) -> str:
        """Bind and serve in a background thread; returns the endpoint."""
        endpoint = self.bind() if self._router is None else self.endpoint
        self._thread = threading.Thread(target=self.serve_forever, name="fuelline-serve", daemon=True)
        self._thread.start()
        return endpoint  # type: ignore[return-value]

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.join(10)

    def _wake(self) -> None:
        # One byte per wake-up, not per batch: the loop clears the flag after emptying the pipe
        # and before it looks at the sessions, so a batch readied after that rings again.
        if self._pipe_closed or self._wake_pending:
            return  # (closed: its fd numbers may belong to someone else by now)
        self._wake_pending = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full, so the loop is already due to wake

    # -- the loop ------------------------------------------------------------------------------
    def serve_forever(self, ready: Callable[[str], None] | None = None) -> None:
        if self._router is None:
            self.bind()
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        tick = min(self.heartbeat / 4, 0.25)
        next_tick = time.monotonic() + tick
        if ready is not None:
            ready(self.endpoint)  # type: ignore[arg-type]
        try:
            while self._stop_reason is None:
                timeout = max(0.0, next_tick - time.monotonic())
                events = dict(poller.poll(timeout * 1000))
                if router in events:
                    self._drain_requests(router)
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self._wake_pending = False  # after the drain, or a ring during it is lost
                for session in list(self.sessions.values()):
                    self._flush(session)
                now = time.monotonic()
                if now >= next_tick:
                    self._keepalive(now)
                    next_tick = now + tick
        finally:
            self._shutdown(self._stop_reason or "server loop ended")

    def _drain_requests(self, router: zmq.Socket) -> None:
        for _ in range(1000):  # bounded, so a flood cannot starve sending
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            self._handle(frames[0], frames[1:])

    def _send(self, rid: bytes, frames: list[Any]) -> bool:
        assert self._router is not None
        try:
            self._router.send_multipart([rid, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.EAGAIN):
                session = self.sessions.get(rid)
                if session is not None:
                    why = "disconnected" if exc.errno == errno.EHOSTUNREACH else "not reading"
                    self._drop(session, why)
                return False
            raise
        session = self.sessions.get(rid)
        if session is not None:
            session.last_sent = time.monotonic()
        return True

    def _reply(self, rid: bytes, code: str, message: str, fatal: bool = True) -> None:
        self._send(rid, encode(Error(code, message, fatal)))

    def _handle(self, rid: bytes, frames: list[bytes]) -> None:
        try:
            msg = decode(frames, limits=self.limits)
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
            session.last_heard = time.monotonic()
        if isinstance(msg, Hello):
            self._hello(rid, msg)
        elif isinstance(msg, (Credit, Heartbeat)):
            if session is None:
                self._reply(rid, ErrorCode.NO_SESSION, "no session for this connection; send Hello", fatal=False)
            elif isinstance(msg, Credit):
                session.grant(msg.n)
                self._flush(session)
        elif isinstance(msg, Bye):
            if session is not None:
                self._drop(session, f"said bye ({msg.reason})" if msg.reason else "said bye", level=logging.INFO)
                if self.recent is not None:
                    self.recent.forget(session.hello.client_id)  # it will not come back for them
        else:
            self._reply(rid, ErrorCode.BAD_REQUEST, f"a client may not send {msg.TYPE} messages")

    def _hello(self, rid: bytes, hello: Hello) -> None:
        src = self.source
        if hello.split not in src.splits:
            self._reply(rid, ErrorCode.UNKNOWN_SPLIT, f"split {hello.split!r} is not served here; this server has splits {list(src.splits)}")
            return
        wanted = hello.sources if hello.sources is not None else src.sources
        for name in wanted:
            if name not in src.sources:
                why = getattr(src, "why_not_servable", lambda n: None)(name)
                detail = why if why else f"this server has sources {list(src.sources)}"
                self._reply(rid, ErrorCode.UNKNOWN_SOURCE, f"cannot serve source {name!r}: {detail}")
                return
        old = self.sessions.pop(rid, None)
        if old is not None:
            old.stop()
        for other in list(self.sessions.values()):
            if other.hello.client_id == hello.client_id:
                self._drop(other, "replaced by a new connection of the same client", level=logging.INFO)
        name = f"{hello.client_id[:12]}#{uuid.uuid4().hex[:6]}"
        session = Session(rid, hello, src, tuple(wanted), self.hwm, self.checksum, self._wake, name, self.recent)
        self.sessions[rid] = session
        self.stats["sessions"] += 1
        schema = src.schema()
        welcome = Welcome(
            session=name,
            stream=hello.stream,
            sources=tuple(wanted),
            schema={k: schema[k] for k in wanted},
            batches_per_epoch=src.batches_per_epoch(hello.split, hello.rank, hello.world_size),
            heartbeat=self.heartbeat,
            info=dict(src.info(hello.split)),
            local=self.local,
            # A source without one (a Fuel-style stream) leaves its clients nothing to hold to.
            fingerprint=getattr(src, "fingerprint", lambda split: None)(hello.split),
        )
        if self._send(rid, encode(welcome)):
            if old is None:
                log.info(
                    "client %s: rank %d of %d, split %r, from epoch %d batch %d",
                    name, hello.rank, hello.world_size, hello.split, hello.epoch, hello.cursor,
                )
            session.start()

    def _flush(self, session: Session) -> None:
        for kind, frames in session.take_sendable():
            if not self._send(session.routing_id, frames):
                return
            if kind == "batch":
                self.stats["batches"] += 1
                self.stats["bytes"] += sum(memoryview(f).nbytes for f in frames[1:])

    def counters(self) -> dict[str, int]:
        """Everything counted so far: batches and bytes sent, sessions, the cache tiers' hits and
        misses, the source's own events (worker restarts, remote fetches...)."""
        out = dict(self.stats)
        if self.recent is not None:
            out.update(self.recent.stats())
        # Read under the counts' own lock: read-ahead, prefetch and worker-pool threads add to
        # them meanwhile, and a dict that grows while it is copied raises.
        counts = getattr(self.source, "counters", None)
        if counts is not None:
            out.update(counts.snapshot() if hasattr(counts, "snapshot") else dict(counts))
        return out

    def _status(self, now: float) -> None:
        """One readable line per interval: what an operator looks at first."""
        batches, nbytes, since = self._status_base
        dt = max(now - since, 1e-9)
        queued = sum(s.queued for s in self.sessions.values())
        counts = self.counters()
        tiers = []
        for tier in ("memory", "decoded", "disk"):
            hits, misses = counts.get(f"cache_{tier}_hits", 0), counts.get(f"cache_{tier}_misses", 0)
            if hits or misses:
                tiers.append(f"{tier} cache {hits} hits / {misses} misses")
        if counts.get("remote_fetches"):
            tiers.append(f"{counts['remote_fetches']} remote fetches ({counts.get('remote_bytes', 0) / 1e6:.1f} MB)")
        log.info(
            "%d clients; %.1f batches/s, %.1f MB/s; %d batches prepared and waiting for credit%s",
            len(self.sessions), (self.stats["batches"] - batches) / dt, (self.stats["bytes"] - nbytes) / dt / 1e6, queued,
            "".join(f"; {t}" for t in tiers),
        )
        self._status_base = (self.stats["batches"], self.stats["bytes"], now)
        self._status_at = now + self.status_interval

    def _keepalive(self, now: float) -> None:
        if self.status_interval and now >= self._status_at:
            self._status(now)
        for session in list(self.sessions.values()):
            if now - session.last_heard > 3 * session.client_heartbeat:
                self.stats["dropped_silent"] += 1
                self._drop(session, f"silent for {now - session.last_heard:.1f}s (3 heartbeat intervals)")
            elif now - session.last_sent >= self.heartbeat:
                self._send(session.routing_id, encode(Heartbeat()))

    def _drop(self, session: Session, why: str, level: int = logging.WARNING) -> None:
        if self.sessions.get(session.routing_id) is session:
            del self.sessions[session.routing_id]
        session.stop()
        log.log(level, "client %s dropped: %s; its buffers are freed", session.name, why)

    def _shutdown(self, reason: str) -> None:
        bye = encode(Bye(reason))
        for session in list(self.sessions.values()):
            self._send(session.routing_id, bye)
            session.stop()
        for session in list(self.sessions.values()):
            session.join(2.0)
        self.sessions.clear()
        if self._router is not None:
            self._router.close()  # LINGER 1000: a Bye still queued gets a second to leave
            self._router = None
        self._stop_auth()
        self._remove_local()
        if self._own_ctx:
            self._ctx.term()
        self._pipe_closed = True
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        counts = {k: v for k, v in self.counters().items() if v}
        log.info("server stopped: %s; totals: %s", reason, ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
