"""LitData (``litdata``): the table converted once with ``optimize`` (one input per row group,
each yielding its rows as samples {features: float32[64] array, label, row_id}, or for the windows
each recording's windows as samples of its sources, arrays of their shape and scalars; chunks of
64 MB, as its README writes it), read with ``StreamingDataset(input_dir=…, shuffle=True)`` through its
``StreamingDataLoader(batch_size=1024, num_workers=K)``, which collates the samples.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import readerlib


def _rows(item: tuple[str, int, str]) -> Iterator[dict[str, Any]]:
    """The samples of one row group: (file, row group index, the data folder)."""
    import pyarrow.parquet as pq

    path, group, data = item
    cols = readerlib.columns(data)
    arrays = readerlib.table_arrays(pq.ParquetFile(path).read_row_group(group), cols)
    for i in range(len(arrays[cols[0].name])):
        yield {c.name: arrays[c.name][i].copy() if c.shape else arrays[c.name][i].item() for c in cols}


def prepare(data: Path) -> None:
    """Write ``data/litdata`` from ``data/parquet`` once (by way of a temporary folder and a rename)."""
    import pyarrow.parquet as pq
    from litdata import optimize

    out = data / "litdata"
    if out.is_dir():
        return
    tmp = data / "litdata.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    inputs = [(str(path), g, str(data)) for path in sorted((data / "parquet").glob("*.parquet"))
              for g in range(pq.ParquetFile(path).num_row_groups)]
    optimize(fn=_rows, inputs=inputs, output_dir=str(tmp), chunk_bytes="64MB", num_workers=1)
    tmp.rename(out)


def main() -> int:
    args = readerlib.parser(__doc__).parse_args()
    try:
        import litdata
        import torch
        from litdata import StreamingDataLoader, StreamingDataset

        data = Path(args.data)
        if args.prepare:
            reused = (data / "litdata").is_dir()
            started = time.perf_counter()
            prepare(data)
            print(json.dumps({"prepared_s": round(time.perf_counter() - started, 2), "reused": reused}), flush=True)
            return 0
        with readerlib.ProcTree() as tree:
            started = time.perf_counter()
            dataset = StreamingDataset(input_dir=str(data / "litdata"), shuffle=True, seed=args.seed)
            loader = StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                         timeout=args.timeout if args.workers else 0)

            names = [c.name for c in readerlib.columns(data)]

            def epoch(e: int) -> Any:
                return (tuple(b[n] for n in names) for b in loader)

            result = readerlib.measure(tree, epoch, args, started)
            readerlib.emit(result, tree, versions={"litdata": litdata.__version__, "torch": torch.__version__})
        return 0
    except Exception as exc:
        return readerlib.fail(exc)


if __name__ == "__main__":
    raise SystemExit(main())
