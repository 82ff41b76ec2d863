"""ZeroMQ certificate files as ``fuelline keygen`` writes them, read and checked the same way by
the server (its key pair, the authorized client keys) and the client (its pair, the server's key)."""

from __future__ import annotations

import logging
import os
from typing import Union

import zmq
import zmq.auth
from zmq.utils import z85

from fuelline.protocol.errors import DataError

__all__ = ["PathLike", "check_key", "load_key_file", "load_public_key_file", "holds_secret_key", "require_curve"]

log = logging.getLogger("fuelline")

PathLike = Union[str, "os.PathLike[str]"]

# A certificate is a few hundred bytes: a file in a key folder is read this far to tell whether
# it holds a secret key, whatever else was put there.
_SCAN_BYTES = 1 << 16


def require_curve() -> None:
    """Raises DataError where libzmq cannot do CURVE."""
    if not zmq.has("curve"):
        raise DataError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE support; install pyzmq's wheel")


def check_key(owner: str, name: str, value: object) -> None:
    """Raises ValueError unless ``value`` is a CURVE key as Z85 text (40 bytes): what
    ``load_certificate`` returns and what libzmq's options take."""
    if not isinstance(value, bytes) or len(value) != 40:
        # (never the value in the message: it may be a secret key)
        size = f" of length {len(value)}" if isinstance(value, (bytes, str)) else ""
        raise ValueError(f"{owner}.{name} must be a CURVE key as 40 bytes of Z85 text, got {type(value).__name__}{size}")
    try:
        z85.decode(value)
    except Exception:
        raise ValueError(f"{owner}.{name} is not Z85 text") from None


def load_key_file(path: PathLike, *, secret: bool = False) -> tuple[bytes, bytes | None]:
    """The (public, secret) keys of a ZeroMQ certificate file; secret is None in a public one.

    Raises:
        DataError: the file is missing or unreadable, holds no key, or (``secret=True``) no secret
            key; the message names the file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"CURVE key file {path} does not exist (`fuelline keygen` writes key files)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeError) as exc:
        raise DataError(f"cannot read CURVE key file {path}: {exc}") from None
    for name, key in (("public", public), ("secret", secret_key)):
        if key is not None:
            try:
                check_key("key", name, key)
            except ValueError:
                raise DataError(f"CURVE key file {path}: its {name} key is not a 40-character Z85 key") from None
    if secret:
        if secret_key is None:
            raise DataError(f"CURVE key file {path} holds no secret key (give the .key_secret file)")
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            log.warning("CURVE secret key %s can be read by others (mode %o); chmod 600 it", path, mode)
    return public, secret_key


def holds_secret_key(path: PathLike) -> bool:
    """Whether the file at ``path`` holds a CURVE secret key, as a ZeroMQ certificate line
    (``secret-key = ...``), whatever its name: ``NAME.key_secret`` holds the public key too,
    and a copy of it is a secret key file under any name. False for what cannot be read, and for
    what is not a regular file (a FIFO would block the read)."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(_SCAN_BYTES)
    except OSError:
        return False
    return any(line.strip().startswith(b"secret-key") for line in head.splitlines())


def load_public_key_file(path: PathLike, *, instead: str) -> bytes:
    """The public key of a ZeroMQ certificate file that must hold nothing else: a key copied from
    its owner (a client's key in the server's ``authorized/``, the server's key on a client).

    Args:
        instead: what to do instead, as the message says it after "a secret key must never leave
            its owner: " (which file to copy, and that the pair is exposed).

    Raises:
        DataError: as ``load_key_file``, or the file holds a secret key; the message names the
            file and says which file to copy instead.
    """
    path = os.fspath(path)
    if holds_secret_key(path):
        raise DataError(
            f"CURVE key file {path} holds a secret key, where a public key belongs: a secret key must never leave "
            f"its owner: {instead}"
        )
    return load_key_file(path)[0]
