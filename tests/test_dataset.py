"""``ServerDataset`` in a torch ``DataLoader``: with 0 or K workers, persistent or not, forked or
spawned, an epoch is every row of the rank's share exactly once, each DataLoader epoch is the
server's next one, and torchdata's ``StatefulDataLoader`` resumes an epoch mid-way."""

from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from fuelline.client import ServerDataset, ServerDataStream  # noqa: E402
from fuelline.client.dataset import worker_run  # noqa: E402

TIMEOUT = 20.0  # the client's and the DataLoader's deadline for any one wait
# 8 000 train rows: world size 3 gives each rank 2 667 rows, 27 batches of 100; with 2 workers,
# runs of 14 and 13. (Ranks 3·r+w of world 6 would cover 2 668 rows: sharding the rank again
# is not its share.)
BATCH = "100"
WORLD = 3
pytestmark = pytest.mark.timeout(60)


def reference(endpoint: str, rank: int, world_size: int, epochs: int) -> list[list[tuple[int, ...]]]:
    """Each epoch's batches (their sample ids) as one reader of the rank gets them."""
    with ServerDataStream(("sample_id",), endpoints=[endpoint], rank=rank, world_size=world_size,
                          timeout=TIMEOUT) as stream:
        return [[tuple(b[0].tolist()) for b in stream.get_epoch_iterator()] for _ in range(epochs)]


def interleaved(batches: list, workers: int) -> list:
    """The order a DataLoader hands out the workers' runs: one batch of each worker in turn."""
    if workers == 0:
        return list(batches)
    runs = []
    for w in range(workers):
        first, count = worker_run(len(batches), w, workers)
        runs.append(batches[first:first + count])
    return [run[i] for i in range(max(map(len, runs))) for run in runs if i < len(run)]


def ids(batches) -> list[tuple[int, ...]]:
    return [tuple(b[0].tolist()) for b in batches]


def loader(endpoint: str, rank: int, world_size: int, workers: int, **options) -> DataLoader:
    dataset = ServerDataset(("sample_id",), endpoints=[endpoint], rank=rank, world_size=world_size, timeout=TIMEOUT)
    timeout = {"timeout": TIMEOUT} if workers else {}
    return DataLoader(dataset, batch_size=None, num_workers=workers, **timeout, **options)


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_each_epoch_is_the_next_one_and_every_row_of_the_ranks_share_once(
    sample_dataset: Path, start_serve, workers: int, persistent: bool
) -> None:
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    expected = reference(server.endpoint, 1, WORLD, 2)
    options = {"persistent_workers": True} if persistent else {}
    dl = loader(server.endpoint, 1, WORLD, workers, **options)
    epochs = [ids(dl), ids(dl)]
    for e in range(2):
        # The rank's own batches, each once, each worker's run in the order the server serves it.
        assert epochs[e] == interleaved(expected[e], workers)
        rows = [i for batch in epochs[e] for i in batch]
        assert len(rows) == len(set(rows)) == 2667
    assert epochs[0] != epochs[1] and sorted(epochs[0]) != sorted(epochs[1])


def test_len_is_the_ranks_batches_per_epoch(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    dl = loader(server.endpoint, 1, WORLD, 2)
    assert len(dl) == len(dl.dataset) == 27
    assert len(ids(dl)) == 27


def test_two_ranks_are_disjoint_and_together_the_whole_epoch(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    rows = {rank: [i for batch in ids(loader(server.endpoint, rank, 2, 2)) for i in batch] for rank in range(2)}
    assert len(rows[0]) == len(set(rows[0])) == len(rows[1]) == len(set(rows[1])) == 4000
    assert not set(rows[0]) & set(rows[1])
    assert sorted(rows[0] + rows[1]) == list(range(8000))


def test_set_epoch_picks_the_epoch_in_new_workers(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    expected = reference(server.endpoint, 0, WORLD, 3)
    dl = loader(server.endpoint, 0, WORLD, 2)
    dl.dataset.set_epoch(2)
    assert ids(dl) == interleaved(expected[2], 2)
    dl.dataset.set_epoch(1)
    assert ids(dl) == interleaved(expected[1], 2)
    assert ids(dl) == interleaved(expected[2], 2)  # and on from there


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch_exactly_once(sample_dataset: Path, start_serve, workers: int) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is in the dev extras")
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    expected = reference(server.endpoint, 1, WORLD, 2)

    def new_loader():
        dataset = ServerDataset(("sample_id",), endpoints=[server.endpoint], rank=1, world_size=WORLD, timeout=TIMEOUT)
        timeout = {"timeout": TIMEOUT} if workers else {}
        return stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=workers, **timeout)

    first_loader = new_loader()
    it = iter(first_loader)
    before = [tuple(next(it)[0].tolist()) for _ in range(11)]
    state = first_loader.state_dict()
    del it, first_loader  # (its workers stop)

    resumed = new_loader()
    resumed.load_state_dict(state)
    after = ids(resumed)
    # Every remaining row once: nothing handed out before comes again, nothing is missing.
    assert len(before) + len(after) == 27
    assert sorted(before + after) == sorted(expected[0])
    assert before + after == interleaved(expected[0], workers)
    # And the loader's next epoch is the server's next one.
    assert sorted(ids(resumed)) == sorted(expected[1])


def test_spawned_workers_read_their_share_and_advance_epochs(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    expected = reference(server.endpoint, 2, WORLD, 2)
    dl = loader(server.endpoint, 2, WORLD, 2, multiprocessing_context="spawn", persistent_workers=True)
    assert ids(dl) == interleaved(expected[0], 2)
    assert ids(dl) == interleaved(expected[1], 2)


def test_a_state_from_another_number_of_workers_is_refused() -> None:
    dataset = ServerDataset(("sample_id",), port=1, rank=0, world_size=1)
    state = dataset.state_dict()
    assert state["workers"] == 1 and state["epoch"] == 0 and state["batches"] == 0
    with pytest.raises(ValueError, match="workers=4"):
        dataset.load_state_dict({**state, "worker": 3, "workers": 4})
    with pytest.raises(ValueError, match="rank=1"):
        dataset.load_state_dict({**state, "rank": 1})


def test_the_client_imports_torch_only_when_serverdataset_is_named() -> None:
    code = ("import sys, fuelline.client as c; assert 'torch' not in sys.modules; "
            "c.ServerDataset; assert 'torch' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


FUEL_SERVER = """
import numpy as np
from fuelline.server import start_server

class Stream:
    sources = ("x",)

    def get_epoch_iterator(self, **kwargs):
        for i in range(6):
            yield (np.full(4, i, dtype=np.int64),)

start_server(Stream(), port=0, hwm=3)
"""


def test_a_fuel_stream_of_unknown_length_is_read_whole_by_one_worker_and_refused_to_several(start_script) -> None:
    """A Fuel-style stream cannot say how many batches an epoch has, so its epoch cannot be cut
    among DataLoader workers: one worker (or none) reads it whole; several are told why not."""
    server = start_script(FUEL_SERVER)
    endpoint = f"127.0.0.1:{server.port}"
    for workers in (0, 1):
        data = ServerDataset(("x",), endpoints=[endpoint], timeout=TIMEOUT)
        options = {"timeout": TIMEOUT} if workers else {}
        got = [int(x[0]) for (x,) in DataLoader(data, batch_size=None, num_workers=workers, **options)]
        assert got == list(range(6)), (workers, got)
    data = ServerDataset(("x",), endpoints=[endpoint], timeout=TIMEOUT)
    with pytest.raises(Exception, match=r"cannot be split among DataLoader workers; use num_workers <= 1"):
        list(DataLoader(data, batch_size=None, num_workers=2, timeout=TIMEOUT))
    # torch joins each worker whose dataset raised for 5 s before it gives up on it, whenever the
    # loader is collected (in a later test): stop them here, and collect the loader now.
    for worker in multiprocessing.active_children():
        worker.terminate()
        worker.join(TIMEOUT)
    gc.collect()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataloader_that_would_batch_the_batches_again_is_refused_with_the_fix(
    sample_dataset: Path, start_serve, workers: int
) -> None:
    """``DataLoader(ServerDataset(...))`` keeps torch's ``batch_size=1``, which would stack each
    served batch into a batch of one ([1, B, ...]) without a word: refused, naming
    ``batch_size=None``, in the main process and from a worker. A collate_fn of the user's own
    batches on purpose and is served."""
    server = start_serve(sample_dataset, "--batch-size", BATCH)
    endpoint = f"127.0.0.1:{server.port}"
    options = {"timeout": TIMEOUT} if workers else {}
    for batch_size in (1, 2):
        data = ServerDataset(("sample_id",), endpoints=[endpoint], timeout=TIMEOUT)
        with pytest.raises(ValueError, match=r"Pass batch_size=None"):
            next(iter(DataLoader(data, batch_size=batch_size, num_workers=workers, **options)))
    data = ServerDataset(("sample_id",), endpoints=[endpoint], timeout=TIMEOUT)
    pairs = DataLoader(data, batch_size=2, num_workers=workers, collate_fn=lambda pair: [b[0] for b in pair], **options)
    first = next(iter(pairs))
    assert [len(ids) for ids in first] == [int(BATCH)] * 2
    for worker in multiprocessing.active_children():
        worker.terminate()
        worker.join(TIMEOUT)
    gc.collect()
