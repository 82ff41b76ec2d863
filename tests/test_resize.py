"""Resuming an epoch on another world size: nothing lost, nothing repeated but padding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.sources.ordering import rank_rows, remaining_order

TIMEOUT = 20.0


@pytest.mark.parametrize("total,batch,history", [
    (103, 5, [(4, 3)]), (1000, 7, [(4, 10), (2, 5)]), (50, 8, [(3, 100)]), (64, 4, [(2, 0)]), (10, 3, [(16, 1)]),
])
def test_remaining_order_keeps_every_row_not_taken_and_no_other(total: int, batch: int, history: list) -> None:
    order = np.random.default_rng(0).permutation(total)
    taken: set[int] = set()
    rest = order
    for world, batches in history:
        for r in range(world):
            taken |= set(rank_rows(rest, r, world)[: batches * batch].tolist())
        rest = remaining_order(order, history[: history.index((world, batches)) + 1], batch)
    assert set(rest.tolist()) == set(range(total)) - taken
    assert len(rest) == len(set(rest.tolist()))  # no row twice
    kept = [x for x in order.tolist() if x not in taken]
    assert rest.tolist() == kept  # and in the epoch's order


def read(endpoint: str, rank: int, world: int, batches: int | None = None, state: dict | None = None):
    """``batches`` batches of the epoch (all if None) as rank of world; returns (ids, state)."""
    with ServerDataStream(("sample_id",), endpoints=[endpoint], rank=rank, world_size=world, timeout=TIMEOUT) as s:
        if state is not None:
            s.load_state_dict(state)
        it = s.get_epoch_iterator()
        ids, count = [], 0
        for b in it:
            ids += b[0].tolist()
            count += 1
            if batches is not None and count == batches:
                break
        return ids, s.state_dict(), count


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4), (3, 1)])
def test_an_epoch_interrupted_at_one_world_size_finishes_at_another(
    sample_dataset: Path, start_serve, before: int, after: int
) -> None:
    server = start_serve(sample_dataset, "--batch-size", "64", "--seed", "2")
    taken, states = [], []
    for rank in range(before):
        ids, state, _ = read(server.endpoint, rank, before, batches=7)
        taken += ids
        states.append(state)
    assert {(s["epoch"], s["cursor"]) for s in states} == {(0, 7)}
    rest, counts = [], []
    for rank in range(after):
        ids, state, count = read(server.endpoint, rank, after, state=states[rank % before])
        rest += ids
        counts.append(count)
        assert state["epoch"] == 1 and state["history"] == []  # the next epoch starts whole
    assert len(set(counts)) == 1  # equal batch counts on the new ranks, too
    remaining = set(range(8000)) - set(taken)
    assert set(rest) == remaining  # nothing lost
    assert not set(rest) & set(taken)  # nothing taken before is served again
    assert len(rest) - len(remaining) == (-len(remaining)) % after  # padding the only duplication


def test_a_resized_position_can_be_resized_again(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "50")
    first = [read(server.endpoint, r, 4, batches=5) for r in range(4)]
    second = [read(server.endpoint, r, 2, batches=9, state=first[r][1]) for r in range(2)]
    assert second[0][1]["history"] == [[4, 5]] and second[0][1]["cursor"] == 9
    third = [read(server.endpoint, r, 3, state=second[r % 2][1]) for r in range(3)]
    ids = [x for part in (first, second, third) for got in part for x in got[0]]
    assert set(ids) == set(range(8000))
    assert len(ids) - 8000 < 3  # padding only, at the very end
