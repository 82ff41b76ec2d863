"""The positional arguments ``ServerDataStream`` accepts: fuelline's and Fuel 0.2's.

fuelline has always taken ``ServerDataStream(sources, host, port, hwm)``; Fuel 0.2 took
``ServerDataStream(sources, produces_examples, host, port, hwm, axis_labels)``. Both run unchanged:
a ``bool`` right after ``sources`` can only be Fuel's ``produces_examples`` (no host is a bool), so
it selects Fuel's order; anything else is fuelline's.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["FUEL_ORDER", "FUELLINE_ORDER", "positional_arguments", "stream_arguments"]

FUELLINE_ORDER = ("host", "port", "hwm")
FUEL_ORDER = ("produces_examples", "host", "port", "hwm", "axis_labels")
# The same defaults as ServerDataStream's signature (where the API reference reads them).
DEFAULTS: dict[str, Any] = {"host": "localhost", "port": 5557, "hwm": 10, "produces_examples": False,
                            "axis_labels": None}


def positional_arguments(args: Sequence[Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """Name the positional arguments after ``sources`` and merge them with the keyword ones.

    Args:
        args: the positional arguments after ``sources``.
        keywords: ``host``, ``port``, ``hwm``, ``produces_examples``, ``axis_labels`` as the
            signature received them: their defaults (or None) where not given by keyword. A
            keyword at its default cannot be told from one not given, so only one that differs
            from it conflicts with a positional argument.

    Returns:
        Every one of those five names with its value (its default where given neither way).

    Raises:
        TypeError: too many positional arguments, or one given both by position and by keyword.
        ValueError: ``produces_examples=True``: a data server sends batches, not single examples.
    """
    order = FUEL_ORDER if args and isinstance(args[0], bool) else FUELLINE_ORDER
    if len(args) > len(order):
        raise TypeError(f"ServerDataStream takes at most {len(order)} positional arguments after sources "
                        f"({', '.join(order)}), got {len(args)}")
    values = dict(zip(order, args))
    for name, value in keywords.items():
        default = DEFAULTS[name]
        if value is None or (type(value) is type(default) and value == default):  # (5557.0 is given)
            continue
        if name in values:
            raise TypeError(f"ServerDataStream got multiple values for argument {name!r}")
        values[name] = value
    merged = {name: values.get(name, default) for name, default in DEFAULTS.items()}
    if merged["produces_examples"]:
        raise ValueError("produces_examples=True is not supported: a fuelline data server sends batches of "
                         "--batch-size examples; pass produces_examples=False")
    return merged


def stream_arguments(given: dict[str, Any], args: Sequence[Any]) -> dict[str, Any]:
    """Every argument of a ``ServerDataStream`` by name, from its ``__init__``'s ``locals()`` and
    its positional arguments after ``sources``: what builds the same stream again.

    Raises:
        TypeError, ValueError: as ``positional_arguments``.
    """
    config = {k: v for k, v in given.items() if k not in ("self", "args", "__class__")}
    config.update(positional_arguments(args, {name: config.get(name) for name in DEFAULTS}))
    return config
