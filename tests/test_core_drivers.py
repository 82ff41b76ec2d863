"""The protocol cores without I/O: a client's link does nothing itself and returns what it does as
actions; a serving core says what its driver must supply, and one that leaves out a hook fails
when it is made, naming the hook, not on its first send."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fuelline.client.link import Action, Connect, Disconnect, HandshakeDone, Link, Transmit
from fuelline.protocol import Batch, Credit, Hello, Welcome, decode, encode
from fuelline.server.serving.core import Sent, ServingCore


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _sent(actions: list[Action]) -> list[Any]:
    return [decode(a.frames) for a in actions if isinstance(a, Transmit)]


def test_a_link_returns_what_it_does_as_actions_and_does_nothing_itself() -> None:
    # The link with no driver at all: fed messages and the time by hand, it answers in actions.
    clock = Clock()
    link = Link("tcp://127.0.0.1:1", Hello(client_id="c", sources=("x",)), hwm=4, heartbeat=1.0, timeout=60.0,
                local=False, clock=clock)
    link.begin(seek=0, epoch=2, cursor=5)
    actions = link.take_actions()
    assert actions[0] == Connect("tcp://127.0.0.1:1")
    (hello,) = _sent(actions)
    assert isinstance(hello, Hello) and (hello.epoch, hello.cursor, hello.credit) == (2, 5, 4)
    assert actions[1].kind == "hello"
    assert link.take_actions() == []  # (taken once)

    welcome = Welcome(session="s", stream=hello.stream, sources=("x",),
                      schema={"x": {"dtype": "int64", "shape": []}}, batches_per_epoch=None, heartbeat=1.0)
    link.receive(encode(welcome))
    assert link.take_actions() == [HandshakeDone()]
    link.receive(encode(Batch(hello.stream, 2, 5, {"x": np.arange(3)})))
    assert link.take_actions() == []

    # The user takes it: credit goes back once nothing is left to take.
    assert link._items.popleft().seq == 5
    link.credit(0, 1)
    (credit,) = _sent(link.take_actions())
    assert isinstance(credit, Credit) and credit.n == 1

    # Silence for more than 3 heartbeats: it closes the transport and opens a new one at once,
    # asking for the batch after the one it received.
    clock.now += 3.5
    link.tick()
    assert link.take_actions() == [Disconnect()]
    assert link.reconnect_due()
    actions = link.take_actions()
    assert actions[0] == Connect("tcp://127.0.0.1:1")
    (again,) = _sent(actions)
    assert isinstance(again, Hello) and (again.epoch, again.cursor) == (2, 6) and again.stream > hello.stream


def test_a_serving_driver_without_transmit_cannot_be_made() -> None:
    class NoTransmit(ServingCore):
        pass

    class Transmits(ServingCore):
        def _transmit(self, rid: bytes, frames: list[Any]) -> Sent:
            return Sent.OK

    with pytest.raises(TypeError, match="_transmit"):
        NoTransmit(None)  # type: ignore[abstract,arg-type]
    assert not getattr(Transmits, "__abstractmethods__", frozenset())


def test_every_base_with_hooks_names_them_as_abstract() -> None:
    # The other bases a subclass must fill in: the serving loop's driver, the worker pool's
    # supervision, and the 1-bit optimizers' steps.
    from fuelline.server.serving.listener import Listener
    from fuelline.server.workers.supervision import WorkerSupervision

    assert Listener.__abstractmethods__ == frozenset({"serve_forever"})
    assert WorkerSupervision.__abstractmethods__ == frozenset({"_handle", "_describe"})
    from fuelline.trainer.onebit_momentum import CompressedMomentum

    assert CompressedMomentum.__abstractmethods__ == frozenset({"_warmup_step", "_compressed_step"})
