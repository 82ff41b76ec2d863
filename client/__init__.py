"""The client side: ``ServerDataStream`` and what keeps it connected, and ``ServerDataset`` for a
torch ``DataLoader``. Needs no torch unless tensors or ``ServerDataset`` are asked for."""

from typing import Any

from fuelline.client.stream import ServerDataStream

__all__ = ["ServerDataStream", "ServerDataset"]


def __getattr__(name: str) -> Any:
    # ServerDataset subclasses torch's IterableDataset: torch is imported when it is first named.
    if name == "ServerDataset":
        from fuelline.client.dataset import ServerDataset

        return ServerDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
