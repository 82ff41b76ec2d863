"""Positions: a checkpoint at an epoch's end resumes on any world size, and a Fuel stream's epoch
is one order for every rank and reconnect, at a memory cost its server bounds."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import RemoteError
from fuelline.server.sources.fuel import DEFAULT_BUFFER_MB, MAX_WORLD

from support.processes import RssSampler, ServerProcess

TIMEOUT = 30.0


def ids_of(batches) -> list[int]:
    return [int(i) for b in batches for i in b["sample_id"]]


# -- an epoch's end, on another world size --------------------------------------------------------
@pytest.mark.parametrize("new_world", [4, 3, 1])
def test_a_position_saved_after_an_epochs_last_batch_resumes_on_another_world_size(
    sample_dataset: Path, start_serve, new_world: int
) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    first: list[int] = []
    states = []
    for rank in range(2):
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], rank=rank, world_size=2,
                              timeout=TIMEOUT) as s:
            it = s.get_epoch_iterator(as_dict=True)
            per_rank = s.batches_per_epoch
            first += ids_of(next(it) for _ in range(per_rank))
            # Where a trainer checkpoints when --checkpoint-every divides the epoch: every batch
            # taken, the epoch's end not yet seen.
            states.append(s.state_dict())
    assert states[0]["epoch"] == 0 and states[0]["cursor"] == per_rank == 40
    assert len(first) == len(set(first)) == 8000

    second: list[int] = []
    for rank in range(new_world):
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], rank=rank, world_size=new_world,
                              timeout=TIMEOUT) as s:
            s.load_state_dict(states[rank % 2])
            assert list(s.get_epoch_iterator()) == []  # the rest of epoch 0: nothing
            second += ids_of(s.get_epoch_iterator(as_dict=True))
            assert s.state_dict()["epoch"] == 2
    padding = -(-8000 // new_world) * new_world - 8000
    assert set(second) == set(first) and len(second) == 8000 + padding


# -- Fuel streams: one order per epoch ------------------------------------------------------------
SHUFFLED = """
import numpy as np
from fuelline.server import start_server
from fuelline.server.sources.fuel import FuelStreamSource

class Shuffled:
    '''Fuel's ShuffledScheme in small: every epoch draws a new permutation from one RandomState.'''
    sources = ("sample_id",)

    def __init__(self, batches):
        self.batches = batches
        self.rng = np.random.RandomState(1)

    def get_epoch_iterator(self, **kwargs):
        for b in self.rng.permutation(self.batches):
            yield (np.arange(4, dtype=np.int64) + 4 * int(b),)

start_server({source}, port=0, hwm=2)
"""


def read(server, rank: int, world: int, state: dict | None = None, take: int | None = None, epochs: int = 1,
         local: bool = True):
    """(batches of each epoch read, the state after) for one client. ``local`` lets it move to
    the server's Unix socket, which is a reconnect: a new session picks up where the first was."""
    with ServerDataStream(endpoints=[server.endpoint], rank=rank, world_size=world, timeout=TIMEOUT,
                          local=local) as s:
        if state is not None:
            s.load_state_dict(state)
        out = []
        for _ in range(epochs):
            it = s.get_epoch_iterator(as_dict=True)
            out.append(ids_of(b for _, b in zip(range(take), it)) if take is not None else ids_of(it))
        return out, s.state_dict()


def test_a_shuffling_fuel_stream_gives_ranks_and_a_reconnect_shares_of_one_order(start_script) -> None:
    server = start_script(SHUFFLED.format(source="Shuffled(24)"))
    (head,), state = read(server, 0, 2, take=5)  # rank 0 reads 5 batches and goes away
    rank1, _ = read(server, 1, 2, epochs=2)
    (rest, later), _ = read(server, 0, 2, state=state, epochs=2)  # and comes back where it was
    assert len(head) == 20 and len(rest) == 28
    for epoch, (a, b) in enumerate([(head + rest, rank1[0]), (later, rank1[1])]):
        assert not set(a) & set(b), f"epoch {epoch}: ranks 0 and 1 got the same rows"
        assert sorted(a + b) == list(range(96)), f"epoch {epoch}: not every row exactly once"
    # Rank r takes batches r, r + 2, ... of the one order: the batches' own order interleaves.
    order0 = [x // 4 for x in (head + rest)[::4]]
    order1 = [x // 4 for x in rank1[0][::4]]
    assert [b for pair in zip(order0, order1) for b in pair] != list(range(24))  # it did shuffle


def test_a_shuffling_fuel_stream_past_its_buffer_is_refused_not_served_in_another_order(start_script) -> None:
    server = start_script(SHUFFLED.format(source="FuelStreamSource(Shuffled(24), buffer_mb=0)"))
    read(server, 0, 2, local=False)  # the whole epoch in one session, with nothing held for rank 1
    with pytest.raises(RemoteError) as info:
        read(server, 1, 2, local=False)
    assert info.value.code == "data"
    assert "not the same on every call" in str(info.value) and "buffer_mb" in str(info.value)


def test_a_deterministic_fuel_stream_past_its_buffer_is_read_again(start_script) -> None:
    code = SHUFFLED.replace("self.rng.permutation(self.batches)", "np.random.RandomState(7).permutation(self.batches)")
    server = start_script(code.format(source="FuelStreamSource(Shuffled(24), buffer_mb=0)"))
    (a,), _ = read(server, 0, 3)
    (b,), _ = read(server, 1, 3)
    (c,), _ = read(server, 2, 3)
    assert sorted(a + b + c) == list(range(96))


# -- Fuel streams: memory a world size costs ------------------------------------------------------
BIG = """
import numpy as np
from fuelline.server import start_server

class Big:
    sources = ("sample_id", "payload")

    def get_epoch_iterator(self, **kwargs):
        for i in range({batches}):
            yield (np.array([i], dtype=np.int64), np.full(2**18, i, dtype=np.float64))  # 2 MB

start_server(Big(), port=0, hwm=2)
"""


@pytest.fixture
def start_measured(tmp_path: Path, servers: list):
    """A server script whose RSS is what it holds: with a fixed mmap threshold, glibc maps every
    large array on its own and gives it back when freed, rather than keep freed batches for reuse."""

    def start(code: str) -> ServerProcess:
        script = tmp_path / f"server-{len(servers)}.py"
        script.write_text(textwrap.dedent(code))
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        servers.append(ServerProcess([sys.executable, str(script)], tmp_path / f"server-{len(servers)}.log", env))
        return servers[-1]

    return start


def test_a_fuel_stream_refuses_a_world_size_past_its_bound(start_measured) -> None:
    server = start_measured(BIG.format(batches=300))
    rss = RssSampler(server.proc.pid)
    with pytest.raises(RemoteError) as info:
        read(server, 0, 2**40)
    grown = rss.stop() - rss.baseline
    assert info.value.code == "data"
    assert f"world size {2**40}" in str(info.value) and str(MAX_WORLD) in str(info.value)
    assert grown < 32, f"the server grew by {grown:.0f} MB to refuse one client"


def test_a_fuel_stream_to_the_largest_world_holds_at_most_its_buffer(start_measured) -> None:
    server = start_measured(BIG.format(batches=400))  # 800 MB an epoch
    rss = RssSampler(server.proc.pid)
    got = {}
    for rank in (0, MAX_WORLD // 2 + 1, MAX_WORLD - 1):
        (got[rank],), _ = read(server, rank, MAX_WORLD)
    grown = rss.stop() - rss.baseline
    # One batch each: rank r < 400 gets batch r; the others are padded with batch r mod 400.
    assert got == {r: [r % 400] for r in got}
    assert grown < DEFAULT_BUFFER_MB + 32, f"the server grew by {grown:.0f} MB for three clients"
