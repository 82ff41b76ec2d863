"""The client side: ``ServerDataStream`` and what keeps it connected. Needs no torch unless
tensors are asked for."""

from fuelline.client.stream import ServerDataStream

__all__ = ["ServerDataStream"]
