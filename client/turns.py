"""Reading a stream's servers in turn: batch k of an epoch comes from server k mod E, so the order
is fixed whichever server is faster, and an epoch ends when every server has ended it, together."""

from __future__ import annotations

import time
from typing import Sequence

from fuelline.client.connection import Connection, Item
from fuelline.protocol import ProtocolError, ReceiveTimeout

__all__ = ["next_item", "take_in_turn"]


def next_item(conn: Connection, seek: int, receive_timeout: float | None, wait: bool = True) -> Item | None:
    """The connection's next item of the user's position ``seek`` (its seek counter); None if ``wait`` is False and
    none has arrived.

    Raises:
        ReceiveTimeout: a live server delivered nothing for ``receive_timeout`` seconds.
    """
    started = time.monotonic()
    while True:
        item = conn.take(0.25 if wait else 0.0)
        if item is None:
            if not wait:
                return None
            if receive_timeout is not None and time.monotonic() - started > receive_timeout:
                raise ReceiveTimeout(f"no batch from {conn.endpoint} in {receive_timeout:.1f}s")
            continue
        if item.seek == seek:
            return item
        # An item of a position left behind by a seek: drop it.


def take_in_turn(conns: Sequence[Connection], cursor: int, seek: int, receive_timeout: float | None,
                 wait: bool = True) -> tuple[Connection, Item | None]:
    """Item ``cursor`` of the epoch and the connection it came from (None if ``wait`` is False and
    it has not arrived).

    Raises:
        ProtocolError: the servers disagree on where the epoch ends.
        ReceiveTimeout: as ``next_item``.
    """
    turn = cursor % len(conns)
    conn = conns[turn]
    item = next_item(conn, seek, receive_timeout, wait)
    if item is not None and item.kind == "end" and len(conns) > 1:
        for e, other in enumerate(conns):
            if e == turn:
                continue
            theirs = next_item(other, seek, receive_timeout)
            assert theirs is not None  # (waited for)
            if turn != 0 or theirs.kind != "end" or theirs.epoch != item.epoch:
                raise ProtocolError(
                    f"servers {[c.endpoint for c in conns]} disagree on where epoch {item.epoch} ends: "
                    f"{conn.endpoint} ended it after {item.seq} batches, {other.endpoint} sent "
                    f"{'its end' if theirs.kind == 'end' else 'batch %d' % theirs.seq} next"
                )
    return conn, item
