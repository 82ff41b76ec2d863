"""A data server's socket side: the ROUTER and its options, CURVE, where it listens (TCP, and a
Unix socket for clients on this host), the pipe that wakes its loop, and its lifecycle.

``fuelline.server.serving.server.Server`` is the loop that serves on it.
"""

from __future__ import annotations

import abc
import logging
import os
import secrets
import threading
from typing import Any, Callable, TypeVar

import zmq

from fuelline.protocol import DataError
from fuelline.protocol.common.ports import check_port
from fuelline.protocol.common.threadnames import name_this_thread
from fuelline.protocol.common.wakepipe import WakePipe
from fuelline.server.serving.inbound import MAX_INBOUND_BYTES
from fuelline.server.serving.keys import CurveConfig, is_loopback, start_authenticator
from fuelline.server.serving.local_ipc import LocalSocketDir
from fuelline.server.serving.shared_port import shared_port_socket

__all__ = ["Listener", "CONTROL_MESSAGES"]

log = logging.getLogger("fuelline.server")

# Messages libzmq may queue to one peer beyond its hwm of batches: Welcome, EndOfEpoch, notices,
# heartbeats. A peer that reads nothing fills them, and is dropped as not reading.
CONTROL_MESSAGES = 16

_L = TypeVar("_L", bound="Listener")


class Listener(abc.ABC):
    """The socket side of a server (see ``Server`` for the arguments)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        hwm: int,
        context: zmq.Context | None,
        curve: CurveConfig | None,
        local_ipc: bool,
        insecure: bool,
        shared_memory: bool = True,
        share_port: bool = False,
    ) -> None:
        port = check_port(port, "port", free=True)  # (libzmq would listen on the port modulo 65536)
        if curve is None and not insecure and not is_loopback(host):
            raise DataError(
                f"refusing to serve on {host} without CURVE: anyone who can reach the port could read the data. "
                "Create keys with `fuelline keygen DIR` and pass curve=CurveConfig.from_dir(DIR), or "
                "insecure=True for a network that is private by other means"
            )
        self.host = host
        self.port = port
        self.share_port = share_port  # listen on a port other serving processes listen on too
        self.hwm = hwm
        self.curve = curve
        self._auth: Any = None  # the ZAP authenticator thread, while CURVE is on
        self.local_ipc = local_ipc
        self.local: dict[str, str] | None = None  # the ipc endpoint and its token, once bound
        self._ipc_dir: LocalSocketDir | None = None
        self.shared_memory = shared_memory
        # Where local clients' batches may be placed in shared memory, once bound: the socket
        # folder, if it is in memory (a folder on disk would write every batch back to it).
        self.slab_folder: str | None = None
        self.endpoint: str | None = None
        # A context of its own, terminated at shutdown: that waits (up to the linger) until
        # libzmq has sent or dropped every zero-copy frame, before their memory can go away.
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._router: zmq.Socket | None = None
        self._stop_reason: str | None = None
        self._wake_pipe = WakePipe()  # rings the loop (its poll watches the pipe's fd)
        self._thread: threading.Thread | None = None

    @abc.abstractmethod
    def serve_forever(self, ready: Callable[[str], None] | None = None) -> None:
        ...

    # -- lifecycle -----------------------------------------------------------------------------
    def bind(self) -> str:
        """Bind the socket; returns ``tcp://host:port`` with the port actually bound."""
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises instead of a silent drop
        router.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        # libzmq queues 1000 messages per peer by default: a client that grants credit and reads
        # nothing would make the server hold that many batches. (Counted in whole messages.)
        router.setsockopt(zmq.SNDHWM, self.hwm + CONTROL_MESSAGES)
        router.setsockopt(zmq.LINGER, 1000)
        address = f"[{self.host}]" if ":" in self.host else self.host
        if ":" in self.host:
            router.setsockopt(zmq.IPV6, 1)
        try:
            self._secure(router)
            if self.share_port:
                self._bind_shared(router, address)
            elif self.port == 0:
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

    def _bind_shared(self, router: zmq.Socket, address: str) -> None:
        """Listen on the port with the other serving processes that share it
        (``fuelline.server.serving.shared_port``): libzmq takes a socket made here."""
        sock = shared_port_socket(self.host, self.port, listen=True)
        self.port = sock.getsockname()[1]
        fd = sock.detach()  # (libzmq owns and closes it from here)
        try:
            router.setsockopt(zmq.USE_FD, fd)
            router.bind(f"tcp://{address}:{self.port}")
        except BaseException:
            os.close(fd)
            raise
        finally:
            router.setsockopt(zmq.USE_FD, -1)  # (the option stays set: the Unix socket's bind would take the fd too)

    def _bind_local(self, router: zmq.Socket) -> None:
        """The Unix socket that clients on this host move to, with the token that proves it."""
        self._ipc_dir = LocalSocketDir()  # (sweeps the folders of servers killed before they could)
        path = self._ipc_dir.socket_path
        router.bind(f"ipc://{path}")
        token = secrets.token_hex(16)
        with open(path + ".token", "w") as f:
            f.write(token)
        self.local = {"endpoint": f"ipc://{path}", "token": token}
        if self.shared_memory:
            if self._ipc_dir.in_memory:
                self.slab_folder = self._ipc_dir.path
            else:
                log.info("the socket folder %s is not in memory: local clients' batches go through the socket",
                         self._ipc_dir.path)

    def _remove_local(self) -> None:
        if self._ipc_dir is not None:
            self._ipc_dir.remove()
            self._ipc_dir = None
            self.slab_folder = None

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
        self._thread = threading.Thread(target=self._serve_in_thread, name="fuelline-serve", daemon=True)
        self._thread.start()
        return endpoint  # type: ignore[return-value]

    def _serve_in_thread(self) -> None:
        name_this_thread("fl-serve")
        self.serve_forever()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self: _L) -> _L:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.join(10)

    def _wake(self) -> None:
        # The loop drains the pipe before it looks at the sessions, so a batch readied after that rings again.
        self._wake_pipe.ring()

    def _close(self) -> None:
        """Close the socket, the authenticator, the ipc folder, the context and the wake pipe."""
        if self._router is not None:
            self._router.close()  # LINGER 1000: a Bye still queued gets a second to leave
            self._router = None
        self._stop_auth()
        self._remove_local()
        if self._own_ctx:
            self._ctx.term()
        self._wake_pipe.close()
