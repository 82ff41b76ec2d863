"""The position a ``ServerDataStream`` saves (``state_dict``) and resumes from (``load_state_dict``).

A state is a plain dict, so that it goes into a torch checkpoint as it is:

  * ``format``: ``STATE_FORMAT``; another is refused.
  * ``epoch``, ``cursor``: the next batch the reader has not handed out.
  * ``rank``, ``world_size``, ``servers``, ``split``: the reader that saved it.
  * ``history``: segments of the epoch run at other world sizes, each ``(world, batches)`` as the
    servers saw it, or ``(world, batches, servers, extra)`` where a reader read ``servers``
    servers in turn and the first ``extra`` of them served one batch more.
  * ``fingerprint``: the sequence fingerprint of the batches read, or None before any server was
    heard from (and in states saved by older clients, which are taken on trust).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["STATE_FORMAT", "Resume", "position_state", "resume_from", "stream_from_state"]

STATE_FORMAT = 1


@dataclass(frozen=True)
class Resume:
    """Where a loaded state puts a stream: the history gains a segment, and the cursor restarts
    at 0, where the saved world size or number of servers differs from the stream's."""

    epoch: int
    cursor: int
    history: tuple
    fingerprint: dict[str, str] | None


def position_state(*, epoch: int, cursor: int, rank: int, world_size: int, servers: int, split: str,
                   history: tuple, fingerprint: Mapping[str, str] | None) -> dict[str, Any]:
    """The ``state_dict`` of a reader at ``(epoch, cursor)`` after ``history``."""
    return {
        "format": STATE_FORMAT,
        "epoch": epoch,
        "cursor": cursor,
        "rank": rank,
        "world_size": world_size,
        "servers": servers,
        "split": split,
        "history": [list(h) for h in history],
        "fingerprint": None if fingerprint is None else dict(fingerprint),
    }


def resume_from(state: Mapping[str, Any], *, split: str, rank: int, world_size: int, servers: int) -> Resume:
    """Check ``state`` against the stream that loads it and say where that stream resumes.

    Raises:
        ValueError: another format, split, or (on the same world size and servers) rank; an invalid
            position or fingerprint. The message names the field.
    """
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"state format {state.get('format')!r} is not {STATE_FORMAT}")
    if state["split"] != split:
        raise ValueError(f"state was saved with split={state['split']!r}, this stream has {split!r}")
    epoch, cursor = state["epoch"], state["cursor"]
    if type(epoch) is not int or type(cursor) is not int or epoch < 0 or cursor < 0:
        raise ValueError(f"state has an invalid position epoch={epoch!r} cursor={cursor!r}")
    history = tuple(tuple(int(x) for x in h) for h in state.get("history", ()))
    saved_servers = int(state.get("servers", 1))
    if state["world_size"] != world_size or saved_servers != servers:
        # The segment just run, as its servers saw it: each of the ``saved_servers`` ranks per
        # reader took cursor // saved_servers batches, the first cursor % saved_servers one more.
        world = int(state["world_size"]) * saved_servers
        segment = ((world, cursor // saved_servers) if saved_servers == 1
                   else (world, cursor // saved_servers, saved_servers, cursor % saved_servers))
        history, cursor = history + (segment,), 0
    elif state["rank"] != rank:
        raise ValueError(f"state was saved by rank {state['rank']}, this stream is rank {rank}")
    return Resume(epoch, cursor, history, _state_fingerprint(state))


def _state_fingerprint(state: Mapping[str, Any]) -> dict[str, str] | None:
    fingerprint = state.get("fingerprint")
    if fingerprint is None:
        return None
    if not isinstance(fingerprint, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in fingerprint.items()):
        raise ValueError(f"state has an invalid fingerprint {fingerprint!r:.200}; expected a map of strings")
    return dict(fingerprint)


def stream_from_state(cls: Callable[..., Any], config: Mapping[str, Any], state: Mapping[str, Any]) -> Any:
    """Rebuild a pickled ``ServerDataStream``: a new stream of the same arguments (connected on
    first use) at the saved position. Without a ``client_id`` of the user's, it gets a new random
    one, so that a copy never takes over the original's sessions."""
    stream = cls(**config)
    stream.load_state_dict(state)
    return stream
