"""Read a data server through a torch DataLoader with worker processes, and resume an epoch::

    fuelline sample data                      # features [16] float32, label int64
    fuelline serve data --batch-size 64 &
    python examples/dataloader.py --server 127.0.0.1:5557 --workers 2

Each pass over the loader is the server's next epoch; the workers share the rank's batches, each
row once. With torchdata installed, the last part saves a StatefulDataLoader mid-epoch and reads
the rest of that epoch in a new loader.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

from fuelline.client import ServerDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:5557", help="HOST:PORT of the data server")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
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
