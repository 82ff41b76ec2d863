"""``SourceOptions``: the options every unit source takes, in one frozen, checked value.

``ParquetSource`` and ``WindowSource`` take them as keyword arguments or as one ``options``
value, and ``fuelline serve`` builds one from its flags, so a new option is added in one place.
A value out of range raises ``OptionError`` naming the argument (``batch_size``); the command
line re-words it with the flag (``--batch-size``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Any

from fuelline.protocol.errors import OptionError

__all__ = ["SourceOptions"]


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """Options of a unit source.

    Attributes:
        batch_size: rows (windows) per batch.
        seed: seeds every epoch's order, with the epoch number.
        shuffle: shuffle across shards each epoch; off: storage order.
        shuffle_block: units (row groups, recordings) whose rows are mixed together.
        order_version: how each block's rows are shuffled: 2, by a generator of the block's
            own (a rank's first batch waits for its own block only); 1, the order served before
            2, for positions saved in it (``fuelline.server.sources.epoch_plan.EpochPlan``).
        on_bad_shard: ``fail`` stops with the name of a shard that cannot be read; ``skip``
            leaves it out, counts it and tells the clients.
        workers: processes that decode units; 0 decodes on threads of the serving process.
        prefetch: blocks ahead whose remote files are fetched into the disk cache.
        decoded_cache_mb: decoded units kept in memory for every reader to share; 0 for none.
        worker_timeout: seconds a worker process may spend on one unit; 0 for no limit.
        cache_dir: local copies of a remote dataset's files (default: the user's cache folder).
        cache_mb: most megabytes of copies kept in ``cache_dir``.
        stage_threads: threads that run user stages, each one client's batch at a time; 0: as
            many as the cores, at least 4.
    """

    batch_size: int = 64
    seed: int = 0
    shuffle: bool = True
    shuffle_block: int = 8
    order_version: int = 2
    on_bad_shard: str = "fail"
    workers: int = 0
    prefetch: int = 0
    decoded_cache_mb: int = 1024
    worker_timeout: float = 300.0
    cache_dir: str | None = None
    cache_mb: int = 10240
    stage_threads: int = 0

    def __post_init__(self) -> None:
        if self.on_bad_shard not in ("fail", "skip"):
            raise OptionError("on_bad_shard", f"must be fail or skip, got {self.on_bad_shard!r}")
        for name, least in (("batch_size", 1), ("shuffle_block", 1), ("cache_mb", 1), ("workers", 0),
                            ("prefetch", 0), ("decoded_cache_mb", 0), ("stage_threads", 0), ("seed", None)):
            object.__setattr__(self, name, _whole(name, getattr(self, name), least))
        if not isinstance(self.order_version, numbers.Integral) or isinstance(self.order_version, bool) \
                or self.order_version not in (1, 2):  # (the versions of fuelline.server.sources.epoch_plan)
            raise OptionError("order_version", f"must be 1 or 2, got {self.order_version!r}")
        object.__setattr__(self, "order_version", int(self.order_version))
        if not isinstance(self.worker_timeout, (int, float)) or not 0 <= self.worker_timeout < math.inf:
            raise OptionError("worker_timeout", f"must be >= 0 seconds, got {self.worker_timeout!r}")

    @classmethod
    def of(cls, options: SourceOptions | None = None, **overrides: Any) -> SourceOptions:
        """``options`` (or the defaults) with ``overrides`` replaced.

        ``block_units``, the old name of ``shuffle_block``, is still taken, with a
        DeprecationWarning.

        Raises:
            TypeError: an override that is not an option; the message lists the options.
            OptionError: a value out of range, naming it.
        """
        if "block_units" in overrides:
            warnings.warn("block_units is now called shuffle_block", DeprecationWarning, stacklevel=3)
            overrides["shuffle_block"] = overrides.pop("block_units")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown source option(s) {unknown}; the options are {sorted(names)}")
        return dataclasses.replace(options if options is not None else cls(), **overrides)


def _whole(name: str, value: Any, least: int | None) -> int:
    """``value`` as an int (numpy integers too), or OptionError."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (least is not None and value < least):
        rule = "a whole number" + (f" >= {least}" if least is not None else "")
        raise OptionError(name, f"must be {rule}, got {value!r}")
    return int(value)
