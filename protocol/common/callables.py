"""``module:function`` as a command line names a function of the user's (a preprocessing stage,
a model factory), imported with errors that name the option and what went wrong."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

from fuelline.protocol.errors import DataError

__all__ = ["load_callable"]


def load_callable(spec: str, option: str, example: str, moved: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """The callable ``spec`` (``package.module:function``) names.

    Args:
        spec: the option's value.
        option: how errors name the option (``--stage``, ``--model``).
        example: a valid value, shown when ``spec`` is not of the form.
        moved: old module names and where they live now, so values written earlier keep working.

    Raises:
        DataError: not of the form, a module that cannot be imported, or no callable of that name;
            the message names the option and the value.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DataError(f"{option} {spec!r}: expected package.module:function, e.g. {example}")
    module_name = (moved or {}).get(module_name, module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DataError(f"{option} {spec!r}: cannot import {module_name!r} ({exc}); is its folder on PYTHONPATH?") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise DataError(f"{option} {spec!r}: {module_name} has no callable {attr!r}")
    return found
