"""CURVE on the client side: the keys a client connects with, and what its handshakes tell.

A server that uses CURVE (``fuelline serve --curve-keys DIR``) accepts only clients whose public
key is in its ``DIR/authorized/``. A client needs its own key pair and the server's public key,
all ZeroMQ certificate files as ``fuelline keygen`` writes them::

    DIR/client.key_secret   this client's key pair (``fuelline keygen DIR --name client``)
    DIR/server.key          the server's public certificate, copied from the server

ZeroMQ refuses a client during the handshake, before any fuelline message, so a refused client
would only see silence. ``HandshakeWatch`` reads the socket's monitor events instead: a refused
key or a CURVE/plain mismatch fails at once, and other failed handshakes are named when the
client gives up. The same events tell a refused TCP connection (nothing listens at the port)
from a server that accepted it and stays silent. A host name that does not resolve looks like a
refusal to them (libzmq retries both alike): when connections are refused, the name is looked up
once, on a thread of its own, so that the client says which it is.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from fuelline.protocol import RemoteError
from fuelline.protocol.common.keyfiles import (
    PathLike,
    check_key,
    holds_secret_key,
    load_key_file,
    load_public_key_file,
    require_curve,
)

__all__ = [
    "CurveKeys", "HandshakeWatch", "load_key_file", "check_key", "require_curve", "CURVE_REFUSED", "CURVE_MISMATCH",
]

log = logging.getLogger("fuelline.client")

# RemoteError codes for refusals that happen in the ZeroMQ handshake, not in a fuelline Error.
CURVE_REFUSED = "curve-refused"  # the server's authenticator refused this client's key
CURVE_MISMATCH = "curve-mismatch"  # one side uses CURVE and the other does not

@dataclass(frozen=True)
class CurveKeys:
    """A client's CURVE key pair and the public key of the server it trusts (Z85 text, 40 bytes).

    Build one with ``CurveKeys.from_dir(DIR)``, or from keys held elsewhere (a secret store).
    ``source`` is the key file the pair was read from (None where it came from elsewhere): what a
    refusal names.
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes
    source: str | None = None

    def __post_init__(self) -> None:
        for name in ("public_key", "secret_key", "server_key"):
            check_key("CurveKeys", name, getattr(self, name))

    @classmethod
    def from_dir(cls, directory: PathLike, name: str = "client", server: str = "server") -> "CurveKeys":
        """Reads ``DIR/client.key_secret`` (this client's pair) and ``DIR/server.key``.

        Raises:
            DataError: a file is missing or unreadable, or ``DIR/server.key`` holds a secret key
                (the server's ``server.key_secret`` copied over): the message names it.
        """
        require_curve()
        directory = os.fspath(directory)
        public, secret = load_key_file(os.path.join(directory, f"{name}.key_secret"), secret=True)
        shared = os.path.join(directory, f"{server}.key")
        if holds_secret_key(shared) and load_key_file(shared)[0] == public:
            instead = (f"this one is a copy of this client's own {name}.key_secret, not the server's key; copy the "
                       f"server's public {server}.key here instead (never {server}.key_secret)")
        else:
            instead = (f"copy the server's public {server}.key here instead (never {server}.key_secret), and make the "
                       "server a new key pair (`fuelline keygen`): this one is exposed")
        server_key = load_public_key_file(shared, instead=instead)
        assert secret is not None  # load_key_file(secret=True) raised otherwise
        return cls(public, secret, server_key, source=os.path.join(directory, f"{name}.key_secret"))

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client; call before ``connect``."""
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_serverkey = self.server_key


class NameLookup:
    """Whether a host name resolves, asked of the system's resolver on a daemon thread: a lookup
    can take seconds where DNS is slow, so callers read ``failure`` once ``done``, or wait a
    bounded moment. Only made when connections are refused, never on the way to a server that answers."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.started = time.monotonic()
        self.failure: str | None = None  # why the name does not resolve, once known
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(port,), name="fuelline-resolve", daemon=True).start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, until: float) -> None:
        """Wait for the answer until monotonic time ``until`` at most."""
        self._done.wait(max(0.0, until - time.monotonic()))

    def _run(self, port: int) -> None:
        try:
            socket.getaddrinfo(self.host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            self.failure = exc.strerror or str(exc)
        except (OSError, UnicodeError) as exc:  # (a name that is not even one: "label too long")
            self.failure = str(exc)
        finally:
            self._done.set()

    @classmethod
    def of(cls, endpoint: str) -> "NameLookup | None":
        """A lookup of ``tcp://HOST:PORT``'s host; None for an address, which needs none, or another transport."""
        if not endpoint.startswith("tcp://"):
            return None
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            return None
        except ValueError:
            pass
        return cls(host, int(port)) if host and port.isdigit() else None


class HandshakeWatch:
    """What the ZMTP handshakes of a connection's sockets said, read from socket monitors.

    ``check()`` reads the events that arrived, without waiting, and returns the error to fail with
    when the server refused this client for good; ``hint()`` says what the handshakes suggest, for
    a client that gives up on a silent server. A monitor is a diagnostic: if one cannot be made,
    the connection works as before and only waits for its timeout.
    """

    EVENTS = (
        zmq.EVENT_CONNECTED
        | zmq.EVENT_CONNECT_RETRIED
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    MAX_EVENTS_PER_CHECK = 100  # bounded, so a flapping peer cannot hold the caller

    def __init__(self, endpoint: str, curve: CurveKeys | None) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self.failures = 0  # failed handshakes since the last one that succeeded
        self.last_failure = ""
        self._state = "none"  # of the latest event: "none", "connected", "succeeded", "failed"
        self._monitor: zmq.Socket | None = None
        self._watched: zmq.Socket | None = None
        self._available = True
        # A connect attempt that ends in a retry without a TCP connection was refused (or the
        # host unreachable): libzmq retries on its own, every reconnect interval.
        self._tcp_up = False  # a TCP connection was made since the socket's last retry
        self.refusals = 0  # refused attempts in a row, across sockets, until a connection is made
        self.refused_since: float | None = None  # monotonic time of the first of them
        self._told = False  # this run of refusals was logged
        # Whether the host name resolves, looked up when a run of refusals starts: both look alike.
        self._lookup: NameLookup | None = None

    def attach(self, sock: zmq.Socket) -> None:
        """Watch ``sock``; call before ``connect``."""
        self.detach()
        try:
            # A fresh inproc address: pyzmq's default is named after the fd, which a closed
            # socket's monitor may still hold.
            self._monitor = sock.get_monitor_socket(self.EVENTS, addr=f"inproc://fuelline-monitor-{uuid.uuid4().hex}")
            self._watched = sock
            self._tcp_up = False
        except (zmq.ZMQError, NotImplementedError) as exc:
            log.debug("no handshake monitor for %s: %s", self.endpoint, exc)
            self._monitor, self._available = None, False

    def detach(self) -> None:
        """Stop watching: call before the watched socket is closed.

        libzmq sends each event to the monitor's PAIR socket with a blocking send, from its I/O
        thread. With the reading end closed (or full) that send never returns, and every socket
        of the context stops with it. So the watched socket stops reporting first, then the
        reading end closes."""
        if self._watched is not None:
            if not self._watched.closed:
                try:
                    self._watched.disable_monitor()
                except zmq.ZMQError as exc:
                    log.debug("disabling the handshake monitor for %s: %s", self.endpoint, exc)
            self._watched = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    @property
    def refused(self) -> bool:
        """The latest connect attempts were refused: nothing listens there (as far as seen)."""
        return self.refused_since is not None

    def refused_for(self, now: float, since: float, limit: float) -> float:
        """Seconds since ``since`` while the connections are refused, else 0. Tells a run of
        refusals once, as such, with ``limit`` (the seconds it will be retried for)."""
        if self.refused_since is None:
            self._told = False
            return 0.0
        if not self._told and self.refusals >= 3 and self._looked_up(now):  # not a server that is just starting
            self._told = True
            unresolved = self.unresolved
            if unresolved is not None:
                log.warning("server %s: %s; retrying for up to %.0fs", self.endpoint, unresolved, limit)
            else:
                log.warning("server %s refuses connections (nothing listens at %s); retrying for up to %.0fs",
                            self.endpoint, _host_port(self.endpoint), limit)
        return now - since

    LOOKUP_WAIT = 1.0  # seconds after its start a name's lookup is waited for, before "refused" is said

    def _looked_up(self, now: float) -> bool:
        return self._lookup is None or self._lookup.done or now - self._lookup.started > self.LOOKUP_WAIT

    @property
    def unresolved(self) -> str | None:
        """Why the host name does not resolve, if its lookup (made when connections were refused)
        found so; None otherwise, and while it is under way."""
        lookup = self._lookup
        if lookup is None or not lookup.done or lookup.failure is None:
            return None
        return f"the host name {lookup.host} does not resolve: {lookup.failure}"

    def check(self) -> RemoteError | None:
        """Reads the events that arrived; the error to fail with if the server refused this client."""
        if self._monitor is None:
            return None
        for _ in range(self.MAX_EVENTS_PER_CHECK):
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return None
            except zmq.ZMQError as exc:
                log.debug("handshake monitor for %s failed: %s", self.endpoint, exc)
                self.detach()
                return None
            error = self._on_event(event["event"], event["value"])
            if error is not None:
                return error
        return None

    def _on_event(self, kind: int, value: int) -> RemoteError | None:
        if kind == zmq.EVENT_CONNECTED:
            self._state = "connected"
            self._tcp_up = True
            self.refusals, self.refused_since = 0, None
            self._lookup = None  # (it resolved: it connected)
        elif kind == zmq.EVENT_CONNECT_RETRIED:
            # Also sent when a connection that was up dropped and libzmq starts over: only a
            # retry with no connection since the previous one is a refusal.
            if not self._tcp_up:
                self.refusals += 1
                if self.refused_since is None:
                    self.refused_since = time.monotonic()
                    if self._lookup is None or self._lookup.done:  # (one at a time)
                        self._lookup = NameLookup.of(self.endpoint)
            self._tcp_up = False
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._state, self.failures, self.last_failure = "succeeded", 0, ""
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and value == 400:
            # ZAP status 400: a definite no (300 would be a temporary failure, worth retrying).
            if self.curve is not None:
                message = _refused(self.curve)
            else:
                message = "the server's authenticator refused this client (ZAP status 400)"
            return RemoteError(CURVE_REFUSED, message, peer=self.endpoint)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve is None:
                message = (
                    "the server requires CURVE authentication and this client has no keys: connect "
                    "with curve_keys=DIR (client.key_secret and the server's server.key; see `fuelline keygen`)"
                )
            else:
                message = "this client uses CURVE (curve_keys) and the server does not"
            return RemoteError(CURVE_MISMATCH, message, peer=self.endpoint)
        else:  # another failed handshake: maybe passing, so only remembered
            self._state = "failed"
            self.failures += 1
            self.last_failure = _describe(kind, value)
        return None

    def hint(self) -> str:
        """Why a server may stay silent, as far as the handshakes tell; "" when they do not."""
        if self.refused:
            if self._lookup is not None:  # (giving up: worth a moment to say which it is)
                self._lookup.wait(self._lookup.started + self.LOOKUP_WAIT)
            return self.unresolved or f"connection refused: nothing listens at {_host_port(self.endpoint)}"
        if self._state == "failed":
            times = "once" if self.failures == 1 else f"{self.failures} times"
            what = f"the handshake failed {times} (last: {self.last_failure})"
        elif self._state == "connected":
            # Also what a proxy or load balancer whose server is down looks like: it accepts the
            # TCP connection and closes it without a word.
            what = "connected, but no handshake completed (what accepts the connection may not be a running fuelline server)"
        elif self._state == "none" and not self._available and self.curve is not None:
            return "if it uses CURVE: is this client's key authorized there, and server.key its public key?"
        else:
            return ""
        if self.curve is not None:
            return (
                f"{what}: the server may not use CURVE, its public key may not be this client's "
                "server.key, or this client's CURVE key may not be authorized there"
            )
        return f"{what}; or the server may require CURVE authentication (connect with curve_keys=DIR)"


def _refused(curve: CurveKeys) -> str:
    """What a client refused by a server's authenticator is told: the key file its key came from,
    the public certificate to give the server, and the key itself (what the server's log shows)."""
    key = curve.public_key.decode("ascii")
    if curve.source is None:
        return (f"the server refused this client's CURVE key (given as CurveKeys, not read from a key file; public "
                f"key {key}): put that public key in a .key certificate in the server's authorized/ directory and "
                "restart the server")
    public = curve.source.removesuffix("_secret")
    return (f"the server refused this client's CURVE key from {curve.source}: copy its public certificate {public} "
            f"into the server's authorized/ directory and restart the server (public key {key})")


def _host_port(endpoint: str) -> str:
    """``host:port`` of ``tcp://host:port`` (what a person types); other endpoints as they are."""
    return endpoint.removeprefix("tcp://")


def _describe(kind: int, value: int) -> str:
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"authentication failed, ZAP status {value}"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"protocol error {value:#x}"
    return os.strerror(value) if 0 < value < 4096 else f"error {value:#x}"
