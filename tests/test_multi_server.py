"""One reader, several data servers: disjoint parts of each rank's share, exactly once, in a fixed order."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError, Hello
from fuelline.server.sources.ordering import rank_rows, remaining_order

TIMEOUT = 20.0
ROWS = 8000  # the train split of the sample dataset
ARGS = ("--batch-size", "64", "--seed", "3")


def read(endpoints: list[str], rank: int, world: int, batches: int | None = None, state: dict | None = None,
         **options) -> tuple[list[list[int]], dict]:
    """Up to ``batches`` batches (all if None) of the next epoch, as lists of sample ids; and the state."""
    with ServerDataStream(("sample_id",), endpoints=endpoints, rank=rank, world_size=world, timeout=TIMEOUT,
                          **options) as s:
        if state is not None:
            s.load_state_dict(state)
        out = []
        for (ids,) in s.get_epoch_iterator():
            out.append(ids.tolist())
            if batches is not None and len(out) == batches:
                break
        return out, s.state_dict()


@pytest.fixture
def two_servers(sample_dataset: Path, start_serve) -> list[str]:
    return [start_serve(sample_dataset, *ARGS).endpoint for _ in range(2)]


def test_two_servers_feed_two_ranks_every_row_exactly_once(two_servers: list[str], sample_dataset: Path, start_serve) -> None:
    per_rank = [read(two_servers, rank, 2)[0] for rank in range(2)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1  # the ranks step in lockstep
    ids = [x for batches in per_rank for batch in batches for x in batch]
    assert set(ids) == set(range(ROWS))
    assert len(ids) - ROWS < 4 * 64  # padding (wrap-around) is the only duplication
    # The reader of rank r takes the span a single server gives rank r, in the servers' turns.
    single = start_serve(sample_dataset, *ARGS).endpoint
    for rank in range(2):
        alone = [x for batch in read([single], rank, 2)[0] for x in batch]
        together = [x for batch in per_rank[rank] for x in batch]
        assert set(together) == set(alone)


def test_batches_come_from_the_servers_in_turn_and_the_order_is_fixed(two_servers: list[str]) -> None:
    first, _ = read(two_servers, 1, 2)
    assert read(two_servers, 1, 2)[0] == first  # deterministic
    # Server e alone, as rank 2·1+e of world 4, serves batches e, e+2, e+4... of the reader's epoch.
    for e, endpoint in enumerate(two_servers):
        alone, _ = read([endpoint], 1 * 2 + e, 4)
        assert first[e::2] == alone


def test_a_server_killed_and_restarted_mid_epoch_loses_and_repeats_nothing(
    sample_dataset: Path, start_serve
) -> None:
    a = start_serve(sample_dataset, *ARGS)
    b = start_serve(sample_dataset, *ARGS)
    expected, _ = read([a.endpoint, b.endpoint], 0, 1)
    with ServerDataStream(("sample_id",), endpoints=[a.endpoint, b.endpoint], hwm=4, heartbeat=0.2,
                          timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        got = [next(it)[0].tolist() for _ in range(21)]
        b.kill()
        b2 = start_serve(sample_dataset, *ARGS, "--port", b.endpoint.rpartition(":")[2])
        got += [batch[0].tolist() for batch in it]
    assert b2.endpoint == b.endpoint
    # The restarted server was asked to resume where the killed one stopped, not from the start.
    resumed = re.search(r"rank 1 of 2, split 'train', from epoch 0 batch (\d+)", b2.wait_log("from epoch 0 batch"))
    assert resumed and int(resumed.group(1)) > 0
    assert got == expected


@pytest.mark.parametrize("after", [(1, 1), (2, 1), (1, 2), (3, 2), (2, 3)])
def test_a_position_moves_to_other_world_sizes_and_server_counts(
    sample_dataset: Path, start_serve, after: tuple[int, int]
) -> None:
    endpoints = [start_serve(sample_dataset, *ARGS).endpoint for _ in range(3)]
    world, servers = after
    # 2 ranks × 2 servers, interrupted after an odd number of batches: server 0 is one ahead.
    before = [read(endpoints[:2], rank, 2, batches=7) for rank in range(2)]
    assert {(s["epoch"], s["cursor"], s["servers"]) for _, s in before} == {(0, 7, 2)}
    rest = [read(endpoints[:servers], rank, world, state=before[rank % 2][1])[0] for rank in range(world)]
    assert len({len(batches) for batches in rest}) == 1
    taken = {x for batches, _ in before for batch in batches for x in batch}
    again = [x for batches in rest for batch in batches for x in batch]
    assert not taken & set(again)  # nothing taken before is served again
    assert set(again) == set(range(ROWS)) - taken  # and nothing is lost
    assert len(again) - len(set(again)) < world * servers  # padding only


def test_remaining_order_with_uneven_ranks_removes_exactly_what_they_took() -> None:
    order = np.random.default_rng(1).permutation(997)
    batch, world, stride, extra, batches = 5, 6, 3, 2, 4
    taken: set[int] = set()
    for r in range(world):
        took = batches + (r % stride < extra)
        taken |= set(rank_rows(order, r, world)[: took * batch].tolist())
    rest = remaining_order(order, [(world, batches, stride, extra)], batch)
    assert rest.tolist() == [x for x in order.tolist() if x not in taken]
    # The pair form is the stride-1 case.
    assert remaining_order(order, [(world, batches)], batch).tolist() == remaining_order(
        order, [(world, batches, 1, 0)], batch).tolist()


@pytest.mark.parametrize("segment", [(4, 1, 5, 0), (4, 1, 2, 2), (4, 1, 0, 0), (2 ** 21, 1), (4, 1, 2)])
def test_hello_refuses_impossible_resume_segments(segment: tuple) -> None:
    with pytest.raises(ValueError, match="history"):
        Hello(client_id="c", history=(segment,))


def test_servers_with_other_options_are_refused_by_name(sample_dataset: Path, start_serve) -> None:
    a = start_serve(sample_dataset, *ARGS).endpoint
    b = start_serve(sample_dataset, "--batch-size", "64", "--seed", "4").endpoint
    with pytest.raises(DataError, match=rf"{a}.*{b}.*seed"):
        read([a, b], 0, 1)


@pytest.mark.parametrize("endpoints,message", [
    (["127.0.0.1:1", "127.0.0.1:1"], "twice"), (["127.0.0.1"], "HOST:PORT"), ([], "at least one"),
])
def test_bad_endpoint_lists_are_refused(endpoints: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerDataStream(endpoints=endpoints, rank=0, world_size=1)


def test_the_stream_command_reads_several_servers(two_servers: list[str]) -> None:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "stream", ",".join(two_servers), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["unique_sample_ids"] == ROWS and report["rows"] >= ROWS
