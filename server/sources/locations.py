"""Where a dataset lives, as people write it: a plain path or a ``scheme://`` URI, shown without
its credentials, and the default folder of the disk cache."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["default_cache_dir", "is_uri", "redact_uri"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_uri(dataset: str) -> bool:
    """True for ``scheme://…``; a plain path (even one holding a colon) is not a URI."""
    return bool(_SCHEME.match(dataset))


def redact_uri(uri: str) -> str:
    """The URI without user info (credentials) or query (endpoint options, keys): what messages show."""
    if not is_uri(uri):
        return uri
    parts = urlsplit(uri)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", "")).rstrip("/")


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/fuelline``, or ``~/.cache/fuelline``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fuelline")
