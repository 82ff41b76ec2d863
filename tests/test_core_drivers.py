"""The protocol cores without I/O say what a driver must supply: one that leaves out a hook fails
when it is made, naming the hook, not on its first send."""

from __future__ import annotations

from typing import Any

import pytest

from fuelline.client.link import Link
from fuelline.server.serving.core import Sent, ServingCore


def test_a_link_driver_without_a_transport_hook_cannot_be_made() -> None:
    class NoTransmit(Link):
        def _connect(self) -> None: ...

        def _disconnect(self) -> None: ...

    with pytest.raises(TypeError, match="_transmit"):
        NoTransmit("tcp://127.0.0.1:1", None)  # type: ignore[abstract,arg-type]


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
