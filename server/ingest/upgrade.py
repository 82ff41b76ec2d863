"""``fuelline upgrade DATASET``: bring a dataset converted by an earlier version to the current
format, in place.

Formats 1 and 2 lack the master grids (``fuelline.server.multimodal.grid``) that servers cut
windows from. Upgrading reads every recording's samples from the Parquet shards, which stay as
they are, resamples them onto their master grids exactly as ``fuelline convert`` does, and writes
the grid files beside the shards; then the new manifest replaces the old one by an atomic rename.
That rename is the only moment the dataset changes format: an upgrade that fails or is interrupted
leaves the old manifest, which servers of earlier versions still serve, and can be run again.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from dataclasses import replace
from typing import Mapping

import pyarrow.parquet as pq
from tqdm import tqdm

from fuelline.protocol import DataError
from fuelline.server.multimodal.align import Signal
from fuelline.server.multimodal.grid import (
    GridWriter,
    grid_file,
    grid_origin,
    grid_points,
    on_master_grid,
    write_zscored,
    zgrid_file,
)
from fuelline.server.multimodal.manifest import (
    FORMAT,
    MANIFEST_NAME,
    NEAREST,
    UPGRADABLE_FORMATS,
    Manifest,
    Placement,
    Recording,
)
from fuelline.server.multimodal.source import stored_samples
from fuelline.server.sources.storage import is_uri

__all__ = ["upgrade"]


def upgrade(dataset: str, progress: bool | None = None) -> tuple[Manifest, str]:
    """Upgrade the dataset at ``dataset`` to ``FORMAT``; returns the manifest and the format it had.

    Raises:
        DataError: a remote dataset, an unknown format, or a shard that cannot be read (named);
            the dataset is left as it was.
    """
    if is_uri(dataset):
        raise DataError(f"{dataset}: upgrade works on a local copy of a dataset; upgrade one and upload "
                        "the files it adds (<modality>/grid-*.arrow, <modality>/zgrid-*.arrow) and its new manifest.json")
    manifest = Manifest.load(dataset, formats=(*UPGRADABLE_FORMATS, FORMAT))
    if manifest.format == FORMAT:
        return manifest, FORMAT
    try:
        placements = _grids(dataset, manifest, sys.stderr.isatty() if progress is None else progress)
        recordings = tuple(replace(r, modalities={m: placements[(r.id, m)] for m in r.modalities})
                           for r in manifest.recordings)
        extra = {**manifest.extra, "upgraded_from": manifest.format}
        return _save(dataset, replace(manifest, recordings=recordings, format=FORMAT, extra=extra)), manifest.format
    except OSError as exc:  # a full disk, a permission, a path in the way
        raise DataError(f"{dataset}: cannot upgrade ({exc}); the dataset is left as it was") from None


def _grids(root: str, manifest: Manifest, progress: bool) -> dict[tuple[str, str], Placement]:
    """Write every grid file (under a temporary name, renamed once complete); the placements
    that name them."""
    spans = {r.id: (grid_origin({m: p.t_first for m, p in r.modalities.items()}),
                    max(p.t_last for p in r.modalities.values())) for r in manifest.recordings}
    by_file: dict[str, list[tuple[Recording, str]]] = defaultdict(list)
    for r in manifest.recordings:
        for m, p in r.modalities.items():
            by_file[p.file].append((r, m))
    out: dict[tuple[str, str], Placement] = {}
    with tqdm(total=sum(map(len, by_file.values())), unit="grid", disable=not progress, file=sys.stderr,
              desc="upgrade") as bar:
        for file, placed in sorted(by_file.items()):
            placed.sort(key=lambda rm: rm[0].modalities[rm[1]].row_group)
            groups = [rm[0].modalities[rm[1]].row_group for rm in placed]
            if groups != list(range(len(groups))):
                raise DataError(f"{os.path.join(root, file)}: recordings sit in row groups {groups}; upgrade needs "
                                "one per row group, in order, as fuelline convert writes them")
            out.update(_grid_file(root, file, placed, spans, manifest, bar))
    return out


def _grid_file(root: str, file: str, placed: list[tuple[Recording, str]], spans: Mapping[str, tuple[float, float]],
               manifest: Manifest, bar: tqdm) -> dict[tuple[str, str], Placement]:
    target = grid_file(file)
    final = os.path.join(root, target)
    temporary = f"{final}.tmp-{os.getpid()}"
    writer = GridWriter(temporary)
    out = {}
    try:
        try:
            shard = pq.ParquetFile(os.path.join(root, file))
        except Exception as exc:
            raise DataError(f"shard {os.path.join(root, file)}: {exc}") from None
        with shard:
            for rec, m in placed:
                p = rec.modalities[m]
                where = f"shard {os.path.join(root, file)}, row group {p.row_group} (recording {rec.id}, {m})"
                try:
                    table = shard.read_row_group(p.row_group, columns=["t", "x"])
                except Exception as exc:
                    raise DataError(f"{where}: {exc}") from None
                x = stored_samples(table.column("x"), len(manifest.modalities[m].channels), where)
                rate = float(manifest.modalities[m].rate)
                t0, t_end = spans[rec.id]
                grid = on_master_grid(Signal(table.column("t").to_numpy(), x, rate, nearest=m in NEAREST), t0,
                                      grid_points(t0, t_end, rate))
                writer.append(grid)
                out[(rec.id, m)] = replace(p, grid_file=target, grid_points=grid.shape[0 if m in NEAREST else 1],
                                           zgrid_file=zgrid_file(file))
                bar.update()
        writer.close()
        os.replace(temporary, final)  # a new file: a server that maps the old one keeps its map
        modality = placed[0][1]
        write_zscored(final, os.path.join(root, zgrid_file(file)), manifest.stats[modality], modality in NEAREST)
    except BaseException:
        writer.discard()
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return out


def _save(root: str, manifest: Manifest) -> Manifest:
    """The new manifest, through a temporary file and a rename; ``dataset_bytes`` counts the grid
    files and the manifest itself (hence the fixed point)."""
    path = os.path.join(root, MANIFEST_NAME)
    others = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(root)
                 for name in names if os.path.join(folder, name) != path and ".tmp-" not in name)
    size = 0
    while True:
        manifest = replace(manifest, dataset_bytes=others + size)
        text = json.dumps(manifest.to_json(), indent=1)
        if len(text.encode()) == size:
            break
        size = len(text.encode())
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return manifest
