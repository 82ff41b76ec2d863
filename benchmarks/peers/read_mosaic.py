"""Mosaic Streaming (``mosaicml-streaming``): the table converted once to MDS with its
``MDSWriter`` (features ``ndarray:float32:64``, label and row id ``int64``, no compression, the
default shard size; for the windows, each source an ``ndarray`` of its dtype and shape or a scalar),
read with ``StreamingDataset(local=…, shuffle=True)`` (its default shuffle,
``py1e``, and block size) through a torch ``DataLoader(batch_size=1024, num_workers=K)``, which
collates its samples.

``streaming`` imports ``torchvision`` for its vision datasets, unused here; the torchvision
wheels this machine can install are built for CUDA torch and cannot load beside the CPU build, so
this reader stands a stub module in for it (nothing of it is called).
"""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import readerlib


def _stub_torchvision() -> None:
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class VisionDataset:  # only subclassed by streaming.vision, never made here
        pass

    datasets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
    datasets.CIFAR10 = VisionDataset  # type: ignore[attr-defined]
    functional.to_tensor = None  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
    for module in (tv, datasets, transforms, functional):
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})


def prepare(data: Path) -> None:
    """Write ``data/mds`` from ``data/parquet`` once (by way of a temporary folder and a rename)."""
    import pyarrow.parquet as pq
    from streaming import MDSWriter

    out = data / "mds"
    if out.is_dir():
        return
    tmp = data / "mds.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cols = readerlib.columns(data)
    columns = {c.name: _encoding(c) for c in cols}
    with MDSWriter(out=str(tmp), columns=columns, compression=None) as writer:
        for path in sorted((data / "parquet").glob("*.parquet")):
            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                arrays = readerlib.table_arrays(pf.read_row_group(g), cols)
                for i in range(pf.metadata.row_group(g).num_rows):
                    writer.write({c.name: np.ascontiguousarray(arrays[c.name][i]) if c.shape else arrays[c.name][i].item()
                                  for c in cols})
    tmp.rename(out)


def _encoding(c: readerlib.Column) -> str:
    """MDS's encoding of a column: an array of fixed dtype and shape, or a scalar."""
    dtype = np.dtype(c.dtype).name
    return f"ndarray:{dtype}:{','.join(map(str, c.shape))}" if c.shape else dtype


def main() -> int:
    args = readerlib.parser(__doc__).parse_args()
    try:
        _stub_torchvision()
        import streaming
        import torch
        from streaming import StreamingDataset
        from torch.utils.data import DataLoader

        data = Path(args.data)
        if args.prepare:
            reused = (data / "mds").is_dir()
            started = time.perf_counter()
            prepare(data)
            print(json.dumps({"prepared_s": round(time.perf_counter() - started, 2), "reused": reused}), flush=True)
            return 0
        with readerlib.ProcTree() as tree:
            started = time.perf_counter()
            dataset = StreamingDataset(local=str(data / "mds"), shuffle=True, shuffle_seed=args.seed,
                                       batch_size=args.batch_size)
            loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                timeout=args.timeout if args.workers else 0)

            names = [c.name for c in readerlib.columns(data)]

            def epoch(e: int) -> Any:
                return (tuple(b[n] for n in names) for b in loader)

            result = readerlib.measure(tree, epoch, args, started)
            readerlib.emit(result, tree, versions={"mosaicml-streaming": streaming.__version__, "torch": torch.__version__})
        return 0
    except Exception as exc:
        return readerlib.fail(exc)


if __name__ == "__main__":
    raise SystemExit(main())
