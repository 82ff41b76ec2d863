"""Your own model in a plain DDP loop: ``ServerDataset``, the 1-bit hook, a checkpoint that resumes::

    fuelline sample data && fuelline serve data --batch-size 64 &
    torchrun --nproc_per_node 2 examples/ddp_own_model.py --server 127.0.0.1:5557 --epochs 2 --checkpoint ckpt
    torchrun --nproc_per_node 2 examples/ddp_own_model.py --server 127.0.0.1:5557 --epochs 3 --checkpoint ckpt --resume

Each rank reads its share of every epoch (torchrun's RANK and WORLD_SIZE). Its checkpoint holds the
model, optimizer, the 1-bit hook's error feedback and the data position: a resume goes on from there.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from fuelline.client import ServerDataset, ServerDataStream
from fuelline.trainer.onebit import OneBitState, onebit_hook


class Classifier(nn.Module):  # logits for ``classes`` from ``features``: the model is yours to change
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.BatchNorm1d(dim), nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="127.0.0.1:5557", help="HOST:PORT of the data server")
    p.add_argument("--epochs", type=int, default=2, help="epochs in all, counting those of a resumed run")
    p.add_argument("--checkpoint", required=True, help="folder of the per-rank checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --checkpoint")
    p.add_argument("--stop-after", type=int, default=0, help="stop (after a checkpoint) after N steps, mid-epoch")
    p.add_argument("--classes", type=int, default=6, help="label values 0 … N-1 (the sample dataset has 6)")
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()
    dist.init_process_group("gloo")  # "nccl" on GPUs, with the model and batches moved there
    train(args, dist.get_rank())
    dist.barrier()  # in order: all ranks done, the group's holders freed, the group (left to the exit, it aborts)
    gc.collect()  # DDP and the hook's state sit in reference cycles of train()'s frames
    dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int) -> None:
    os.makedirs(args.checkpoint, exist_ok=True)
    path = os.path.join(args.checkpoint, f"rank{rank}.pt")
    with ServerDataStream(("features",), endpoints=[args.server], timeout=30.0) as probe:
        dim = probe.schema["features"]["shape"][0]
    data = ServerDataset(("features", "label"), endpoints=[args.server], timeout=30.0)
    # In the main process (num_workers=0) the dataset holds the position; with worker processes,
    # use torchdata's StatefulDataLoader and checkpoint its state_dict() instead.
    loader = DataLoader(data, batch_size=None, num_workers=0)
    model = DistributedDataParallel(Classifier(dim, args.classes))
    onebit = OneBitState(warmup_iters=10)
    onebit.name_parameters(model.module)  # error feedback keyed by parameter name: it survives a resume
    model.register_comm_hook(onebit, onebit_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first = steps = 0
    if args.resume:
        saved = torch.load(path, weights_only=True)
        for holder, key in ((model.module, "model"), (optimizer, "optimizer"), (onebit, "onebit")):
            holder.load_state_dict(saved[key])
        first, done, steps = saved["data"]["epoch"], saved["data"]["batches"], saved["steps"]
        if rank == 0:
            print(f"resumed at epoch {first}, after {done} of its {len(data)} batches", flush=True)
        if done < len(data):
            data.load_state_dict(saved["data"])  # the next iterator is the rest of the saved epoch
        else:  # saved at the end of its epoch: the next one starts afresh
            first += 1
            data.set_epoch(first)
    for epoch in range(first, args.epochs):
        total, batches = 0.0, 0
        for features, label in loader:
            loss = nn.functional.cross_entropy(model(features), label)
            optimizer.zero_grad()
            loss.backward()  # the 1-bit hook averages the gradients across the ranks
            optimizer.step()
            total, batches, steps = total + loss.item(), batches + 1, steps + 1
            if steps == args.stop_after:
                break
        state = dict(model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                     onebit=onebit.state_dict(), data=data.state_dict(), steps=steps)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # killed while saving, a run keeps its previous checkpoint
        if rank == 0:
            print(f"epoch {epoch}: {batches} batches, loss {total / max(batches, 1):.4f}", flush=True)
        if steps == args.stop_after:
            break


if __name__ == "__main__":
    main()
