"""Read a data server through a torch DataLoader, and resume an epoch::

    fuelline sample data                      # features [16] float32, label int64
    fuelline serve data --batch-size 64 &
    python examples/dataloader.py --server 127.0.0.1:5557

Each pass over the loader is the server's next epoch. With torchdata installed, the last part
saves a StatefulDataLoader mid-epoch and reads the rest of that epoch in a new loader.

Workers: the data server already reads and batches in processes of its own, so ``num_workers=0``
is the fast setup; a worker only adds a copy through the DataLoader's queue (2 workers read a
quarter of the rows/s at three times the CPU per row, ``python -m benchmarks loader-workers``).
``--workers K`` shows that they work all the same: they share the rank's batches, each row once.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

from fuelline.client import ServerDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:5557", help="HOST:PORT of the data server")
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader worker processes (0, the default, is the fast setup with a data server)")
    args = parser.parse_args()

    def dataset() -> ServerDataset:
        return ServerDataset(("features", "label"), endpoints=[args.server], timeout=30.0)

    loader = DataLoader(dataset(), batch_size=None, num_workers=args.workers, timeout=60,
                        pin_memory=torch.cuda.is_available())
    for epoch in range(2):
        rows = sum(len(label) for _features, label in loader)
        print(f"epoch {epoch}: {len(loader)} batches, {rows} rows")

    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return
    first = StatefulDataLoader(dataset(), batch_size=None, num_workers=args.workers, timeout=60)
    batches = iter(first)
    seen = sum(len(next(batches)[1]) for _ in range(3))
    state = first.state_dict()  # goes into a checkpoint as it is
    del batches, first

    resumed = StatefulDataLoader(dataset(), batch_size=None, num_workers=args.workers, timeout=60)
    resumed.load_state_dict(state)
    rest = sum(len(label) for _features, label in resumed)
    print(f"epoch 0 again: {seen} rows before the checkpoint, {rest} after it")


if __name__ == "__main__":
    main()
