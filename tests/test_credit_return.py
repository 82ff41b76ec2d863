"""Who returns the client's credit: a real server, a real ServerDataStream, its real threads.

A send wakes libzmq's I/O thread, which on a busy host can cost the sending thread its time
slice; the consumer's thread should not pay that between two training steps. While batches
remain to take, the keep-alive thread returns the credit as the consumer trains; the consumer's
own thread sends it only when it has nothing left to take.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream
from fuelline.client.connection import Connection
from fuelline.protocol import Credit

from support.processes import wait_until

TIMEOUT = 20.0
HWM = 8  # credit goes back in groups of hwm // 4 = 2


@pytest.fixture
def credits_sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every Credit the client's connections send, with the name of the thread that sent it (the
    send itself still happens, unchanged)."""
    sent: list[tuple[str, int]] = []
    send = Connection._send

    def recording(self: Connection, msg: object) -> None:
        if isinstance(msg, Credit):
            sent.append((threading.current_thread().name, msg.n))
        send(self, msg)

    monkeypatch.setattr(Connection, "_send", recording)
    return sent


def test_credit_goes_back_from_the_keepalive_thread_while_the_consumer_trains(
    sample_dataset: Path, start_serve, credits_sent: list[tuple[str, int]]
) -> None:
    server = start_serve(sample_dataset, "--batch-size", "10", "--hwm", str(HWM))
    with ServerDataStream(None, port=server.port, hwm=HWM, timeout=TIMEOUT, receive_timeout=TIMEOUT) as stream:
        batches = stream.get_epoch_iterator()
        next(batches)
        (conn,) = stream._conns
        # The server's prefetch arrives and is decoded meanwhile: the takes below never run dry.
        wait_until(lambda: len(conn._items) >= HWM - 1, TIMEOUT, "the prefetched batches")
        before = len(credits_sent)
        for _ in range(4):
            next(batches)
            # "Training": the consumer leaves the connection alone until its credit is back.
            wait_until(lambda: conn._pending_credit < 2, TIMEOUT, "credit returned while the consumer trains")
        during = credits_sent[before:]
    consumer = threading.main_thread().name
    assert [c for who, c in during if who == consumer] == [], "the consumer's thread sent credit"
    assert sum(c for _, c in during) == 4, during  # all of it, from the keep-alive thread
    assert all(who.startswith("fuelline-keepalive-") for who, _ in during), during


def test_credit_lost_in_transit_is_made_good_by_the_clients_heartbeat(
    sample_dataset: Path, start_serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection reset that libzmq reconnects under the same routing id drops what was queued
    on the old connection, Credits included. Lose all of a client's credit that way and, without
    more, both sides wait forever while their heartbeats say all is well: the server for credit,
    the client for batches. The client's heartbeat says how much credit it granted; the server
    makes good what never arrived."""
    hwm = 2
    lost: list[int] = []
    losing = threading.Event()  # set once the first batch is taken: credit returned from then on is lost
    send = Connection._send

    def lossy(self: Connection, msg: object) -> None:
        if isinstance(msg, Credit) and losing.is_set() and sum(lost) < hwm:
            lost.append(msg.n)  # (never sent: lost on the wire)
            return
        send(self, msg)

    monkeypatch.setattr(Connection, "_send", lossy)
    server = start_serve(sample_dataset, "--batch-size", "100", "--hwm", str(hwm), "--heartbeat", "0.2")
    with ServerDataStream(None, port=server.port, hwm=hwm, heartbeat=0.2, timeout=TIMEOUT, receive_timeout=10.0) as stream:
        batches = stream.get_epoch_iterator()
        taken = [next(batches)]
        losing.set()
        taken += list(batches)
    assert sum(lost) >= hwm, lost  # every credit the server could have used was lost
    assert len(taken) == 8000 // 100
