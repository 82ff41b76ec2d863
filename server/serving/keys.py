"""CURVE keys for the server: ``fuelline keygen DIR [--name NAME]`` and ``CurveConfig``.

A server bound off loopback encrypts and authenticates with CurveZMQ. The files, all ZeroMQ
certificates as pyzmq's ``zmq.auth.create_certificates`` writes them::

    server side                              client side
    KEYS/server.key_secret  (the pair)       CKEYS/client.key_secret  (the pair)
    KEYS/server.key         ── copy ──▶      CKEYS/server.key
    KEYS/authorized/alice.key  ◀── copy ──   CKEYS/client.key

``fuelline serve DATASET --curve-keys KEYS`` accepts only clients whose public key is in
``KEYS/authorized/``; ``ServerDataStream(..., curve_keys=CKEYS)`` connects with them. The server
reads ``authorized/`` when it starts: restart it after adding or removing a client.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Union

import zmq
import zmq.auth

from fuelline.protocol import DataError
from fuelline.protocol.common.keyfiles import (
    check_key,
    holds_secret_key,
    load_key_file,
    load_public_key_file,
    require_curve,
)

__all__ = ["CurveConfig", "keygen", "is_loopback"]

log = logging.getLogger("fuelline.server")

PathLike = Union[str, "os.PathLike[str]"]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine: 127.0.0.0/8, ::1 or localhost."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name, "*" or an interface name: assume it is reachable
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class CurveConfig:
    """A server's CURVE key pair (Z85 text) and the directory of the client keys it accepts."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    authorized: str  # directory of client public certificates, one ``*.key`` per client

    def __post_init__(self) -> None:
        check_key("CurveConfig", "public_key", self.public_key)
        check_key("CurveConfig", "secret_key", self.secret_key)
        if not isinstance(self.authorized, str) or not self.authorized:
            raise ValueError(f"CurveConfig.authorized must be a directory path, got {self.authorized!r}")

    @classmethod
    def from_dir(cls, directory: PathLike) -> "CurveConfig":
        """Reads ``DIR/server.key_secret`` and checks ``DIR/authorized/``.

        Raises:
            DataError: a key file or the authorized directory is missing or unreadable; the
                message names it.
        """
        require_curve()
        directory = os.fspath(directory)
        public, secret = load_key_file(os.path.join(directory, "server.key_secret"), secret=True)
        assert secret is not None  # load_key_file(secret=True) raised otherwise
        shared = os.path.join(directory, "server.key")
        instead = ("clients copy this file, so put only the public key in it (the server.key `fuelline keygen` "
                   "wrote beside server.key_secret), and make a new key pair if clients copied it already")
        if os.path.exists(shared) and load_public_key_file(shared, instead=instead) != public:
            # Clients trust server.key: one that is not this pair's would lock them all out.
            raise DataError(f"{shared} is not the public half of {directory}/server.key_secret")
        config = cls(public, secret, os.path.join(directory, "authorized"))
        config.client_keys()  # fail now, naming the file, rather than in the authenticator
        return config

    def client_keys(self) -> dict[bytes, str]:
        """The authorized client public keys (Z85), each with the file it came from.

        Raises:
            DataError: the directory is missing, a ``*.key`` file is unreadable, or a file there
                holds a secret key, whatever its name (``NAME.key_secret`` copied over instead of
                ``NAME.key``); the message names the file.
        """
        if not os.path.isdir(self.authorized):
            raise DataError(
                f"CURVE: no directory {self.authorized}; create it and put there the public "
                "certificate (.key file) of every client to accept"
            )
        instead = (f"copy the client's public NAME.key (never NAME.key_secret) into {self.authorized}/ instead, "
                   "delete this file, and have that client make a new key pair (`fuelline keygen`): this one is exposed")
        keys: dict[bytes, str] = {}
        for name in sorted(os.listdir(self.authorized)):
            path = os.path.join(self.authorized, name)
            # Every file is looked at, not only *.key: a secret key is refused under any name.
            authorized = name.endswith(".key") and not name.startswith(".")
            if authorized or holds_secret_key(path):
                keys[load_public_key_file(path, instead=instead)] = path
        if not keys:
            log.warning("CURVE: no client keys (*.key) in %s: every client will be refused", self.authorized)
        return keys


class _AuthorizedKeys:
    """The authenticator's credentials provider: a fixed set of keys, refusals logged.

    pyzmq's own ``configure_curve(location=...)`` logs a refusal only at DEBUG; an operator wants
    to see which client was refused, once (a refused client retries; a stranger may flood). A
    refused key is in none of the files read at start-up; where a file holding it was added to
    the folder since, the message names that file.
    """

    MAX_REMEMBERED = 256  # refused keys told at WARNING (and looked for in the folder), at most

    def __init__(self, keys: dict[bytes, str], location: str) -> None:
        self.keys = keys
        self.location = location
        self._refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        first = key not in self._refused and len(self._refused) < self.MAX_REMEMBERED
        if first:
            self._refused.add(key)
        log.log(logging.WARNING if first else logging.DEBUG, "%s", self.refusal(key, look=first))
        return False

    def refusal(self, key: bytes, look: bool = True) -> str:
        """What the log says of a refused ``key``: the file that holds it if one was added since
        the server started (with ``look``), else the files it is in none of; the key last."""
        text = key.decode("ascii", "replace")
        added = _file_holding(key, self.location) if look else None
        if added is not None:
            return (f"refused a client: its CURVE key is in {added}, added after this server read "
                    f"{self.location} at start-up; restart the server to accept that client (public key {text})")
        files = sorted(self.keys.values())
        if not files:
            where = f"{self.location} holds no client key files"
        elif len(files) == 1:
            where = f"its CURVE key is not the one in {files[0]}"
        else:
            shown = ", ".join(os.path.basename(path) for path in files[:5])
            more = f" and {len(files) - 5} more" if len(files) > 5 else ""
            where = f"its CURVE key is in none of the {len(files)} key files of {self.location} ({shown}{more})"
        return (f"refused a client: {where}; to accept it, copy the client's public NAME.key into {self.location} "
                f"and restart the server (public key {text})")


def _file_holding(key: bytes, location: str) -> str | None:
    """The ``*.key`` file in ``location`` whose public key is ``key``, if there is one (read now:
    a file that cannot be read is passed over)."""
    try:
        names = sorted(os.listdir(location))
    except OSError:
        return None
    for name in names:
        path = os.path.join(location, name)
        if not name.endswith(".key") or name.startswith(".") or holds_secret_key(path):
            continue
        try:
            if load_key_file(path)[0] == key:
                return path
        except DataError:
            continue
    return None


def start_authenticator(context: zmq.Context, curve: CurveConfig) -> "zmq.auth.thread.ThreadAuthenticator":
    """Start ZAP authentication on ``context`` for sockets that are CURVE servers; stop() it
    before the context is terminated."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = curve.client_keys()
    auth = ThreadAuthenticator(context, log=logging.getLogger("fuelline.server.auth"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AuthorizedKeys(keys, curve.authorized))
    log.info("CURVE: %d authorized client keys in %s", len(keys), curve.authorized)
    return auth


def keygen(directory: PathLike, name: str = "server") -> tuple[str, str]:
    """Write a new CURVE key pair: ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (mode 600).

    Raises:
        FileExistsError: either file exists (keys are never overwritten).
    """
    require_curve()
    directory = os.fspath(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    targets = [os.path.join(directory, name + ext) for ext in (".key", ".key_secret")]
    for path in targets:
        if os.path.lexists(path):
            raise _exists(path)
    # Written in a private folder beside the targets, so the secret is never readable by others,
    # then linked into place: a link fails rather than replace a file that appeared meanwhile.
    scratch = tempfile.mkdtemp(prefix=".keygen-", dir=directory)
    made: list[str] = []
    try:
        sources = zmq.auth.create_certificates(scratch, name)
        os.chmod(sources[1], 0o600)
        os.chmod(sources[0], 0o644)
        for source, target in zip(sources, targets):
            _place(source, target)
            made.append(target)
    except BaseException:
        for path in made:
            os.unlink(path)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return targets[0], targets[1]


def _exists(path: str) -> FileExistsError:
    return FileExistsError(f"{path} exists; keygen never overwrites a key (remove it, or choose another name)")


def _place(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except FileExistsError:
        raise _exists(target) from None
    except OSError:  # a file system without hard links: check, then move (a narrow race)
        if os.path.lexists(target):
            raise _exists(target) from None
        os.replace(source, target)
