"""What the servers' Welcomes say about the sequence they serve: whether the servers of one
reader agree on it (named by the ``fuelline serve`` option that differs, as the user set it), and
what a server left out of it at start-up (``--on-bad-shard skip``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from fuelline.protocol import DataError, FingerprintMismatch

__all__ = ["check_agreement", "option_differences", "left_out_at_start", "idle_processes"]

# The parts of a sequence fingerprint (and of a Welcome's info) that a `fuelline serve` option
# sets, with that option. The other parts (files, manifest, recordings) are the dataset's.
FLAGS = {
    "batch_size": "--batch-size",
    "seed": "--seed",
    "shuffle": "--shuffle",
    "shuffle_block": "--shuffle-block",
    "order": "--order-version",
    "window": "--window",
    "hop": "--hop",
    "max_gap": "--max-gap",
    "normalize": "--normalize",
    "stages": "--stage",
}
SKIPPED = ("skipped_shards", "skipped_recordings")  # what a Welcome's info lists, per kind of source


def _setting(welcome: Any, part: str) -> str:
    """An option's value as the user gave it: from the info where the server reports it (the
    fingerprint holds strings, and leaves out what orders nothing), else the fingerprint's part."""
    info = welcome.info or {}
    value = info.get(part, (welcome.fingerprint or {}).get(part))
    if part == "shuffle":
        return "--shuffle" if str(value).lower() == "true" else "--no-shuffle"
    if part == "stages":
        stages = ",".join(value) if isinstance(value, (list, tuple)) else value
        return f"--stage {stages}" if stages else "no --stage"
    return "unset" if value is None else f"{FLAGS[part]} {value}"


def option_differences(first: Any, other: Any, first_at: str, other_at: str) -> str:
    """``"--batch-size 64 at A and --batch-size 128 at B"`` for each option the two Welcomes
    differ in; "" where no option explains the difference (other files, say). With fingerprints,
    only the options whose parts differ are named: a seed without shuffling orders nothing."""
    if first.fingerprint is not None and other.fingerprint is not None:
        parts = [p for p in FLAGS if first.fingerprint.get(p) != other.fingerprint.get(p)]
    else:  # a server of a Fuel stream sends no fingerprint: its info is all there is
        parts = [p for p in FLAGS if (first.info or {}).get(p) != (other.info or {}).get(p)]
    said = [(_setting(first, p), _setting(other, p)) for p in parts]
    # (Turning shuffling off drops the seed's part too, though the seed itself is the same.)
    return "; ".join(f"{a} at {first_at} and {b} at {other_at}" for a, b in said if a != b)


def check_agreement(endpoints: Sequence[str], welcomes: Sequence[Any]) -> None:
    """Servers read together must serve the same sequence, or the shares they serve would not
    fit together: the same sequence fingerprint, and the same sources and schema for this
    reader's request. Where the dataset lies, cache counters and other local facts in ``info``
    may differ: the same files on two mounts serve the same sequence.

    Raises:
        FingerprintMismatch: two servers' fingerprints differ (the message starts with the
            options that differ, as ``fuelline serve`` takes them).
        DataError: they agree on the fingerprint (or send none) but not on the sources, schema
            or number of batches.
    """
    first = welcomes[0]
    for endpoint, w in zip(endpoints[1:], welcomes[1:]):
        options = option_differences(first, w, endpoints[0], endpoint)
        context = (f"servers {endpoints[0]} and {endpoint} serve different sequences"
                   + (f", started with {options}" if options else "") + ": ")
        if w.fingerprint != first.fingerprint:
            if first.fingerprint is None:
                raise FingerprintMismatch(w.fingerprint, None, f"at {endpoint}", f"at {endpoints[0]}", context)
            raise FingerprintMismatch(first.fingerprint, w.fingerprint, f"at {endpoints[0]}", f"at {endpoint}", context)
        for key in ("sources", "schema", "batches_per_epoch"):
            if getattr(w, key) != getattr(first, key):
                raise DataError(f"{context}{key} is {getattr(first, key)!r:.200} at {endpoints[0]} and "
                                f"{getattr(w, key)!r:.200} at {endpoint}; start every server of a reader with "
                                "the same dataset and options")


def idle_processes(endpoints: Sequence[str], welcomes: Sequence[Any], world_size: int) -> str:
    """What to tell a reader (one entry per connection in ``endpoints``, a server's repeated for
    each of its connections) whose ranks hold fewer connections in all to a server than it has
    serving processes (``fuelline serve --processes``): some of those then prepare none of the
    job's batches. "" when every process can have a part."""
    per_server = len(endpoints) // len(set(endpoints))
    said = [(w.info or {}).get("serving_processes") for w in welcomes]
    # (A server's word only: anything but a whole number is not taken, and nothing fails on it.)
    processes = max([n for n in said if type(n) is int] or [1])
    sessions = world_size * per_server
    if processes <= sessions:
        return ""
    return (f"the data server has {processes} serving processes, and {world_size} rank(s) read it over {per_server} "
            f"connection(s) each: {processes - sessions} of its processes prepare none of these batches; "
            f"connections={-(-processes // world_size)} (--connections) would have each prepare a part")


def left_out_at_start(info: Mapping[str, Any]) -> list[str]:
    """The shards or recordings a server left out when it started, in words, as its Welcome
    lists them (the first few, then how many more)."""
    out = []
    for key in SKIPPED:
        for x in info.get(key) or ():
            name = f"shard {x['file']}" if "file" in x else f"recording {x.get('recording')}"
            reason = str(x.get("reason", ""))
            said = reason if str(x.get("file", x.get("recording"))) in reason else f"{name}: {reason}"
            out.append(f"{said}; left out of split {x.get('split')!r} at start-up (--on-bad-shard skip)")
        if info.get(f"{key}_more"):
            out.append(f"{info[f'{key}_more']} (--on-bad-shard skip)")
    return out
