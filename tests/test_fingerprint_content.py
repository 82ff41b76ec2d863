"""The sequence fingerprint is taken from what the files hold, not from their names and times.

A shard or grid file replaced by other content of the same size, its modification time kept (``cp
-p``, ``rsync -t``, ``touch -r``), and the server restarted with the same options: a saved position
resumed there must raise ``FingerprintMismatch`` naming the part, before any batch is handed out.
The content is read from the files' footers only: never their data, at start-up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError, FingerprintMismatch
from fuelline.server.multimodal.grid import GridWriter, grid_arrays
from fuelline.server.multimodal.manifest import Manifest
from fuelline.server.multimodal.source import WindowSource, stored_samples
from fuelline.server.sources.fingerprint import CONTENT_KEY, ContentDigest, read_parquet_footer
from fuelline.server.sources.parquet import ParquetSource

TIMEOUT = 20.0
SHARD_ROWS = 2000


def write_plain_shard(path: Path, ids: np.ndarray) -> None:
    """A shard as another tool writes it: sample ids and one fixed-width feature, uncompressed and
    plainly encoded, so that other ids make a file of the very same size."""
    table = pa.table({"sample_id": pa.array(ids, pa.int64()), "x": pa.array(ids.astype(np.float32) / 10)})
    pq.write_table(table, path, compression="none", use_dictionary=False, row_group_size=500)


def replace_keeping_time(target: Path, replacement: Path) -> None:
    """``cp -p replacement target``: other bytes under the same name, size and modification time."""
    before = target.stat()
    assert replacement.stat().st_size == before.st_size, "the replacement must be of the same size"
    assert replacement.read_bytes() != target.read_bytes()
    shutil.copyfile(replacement, target)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))


def position_after(endpoint: str, batches: int, sources: tuple[str, ...] = ("sample_id",)) -> dict:
    """The saved position of a reader that took ``batches`` batches from a server."""
    with ServerDataStream(sources, endpoints=[endpoint], timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        for _ in range(batches):
            next(it)
        return s.state_dict()


def resume_error(endpoint: str, state: dict, sources: tuple[str, ...] = ("sample_id",)) -> FingerprintMismatch:
    with ServerDataStream(sources, endpoints=[endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        with pytest.raises(FingerprintMismatch) as info:
            next(s.get_epoch_iterator())
    return info.value


def with_padding_before_footer(data: bytes, size: int) -> bytes:
    """A Parquet file's bytes grown to ``size`` by filler between its last page and its footer,
    which readers never look at (the footer says where every page is)."""
    footer = int.from_bytes(data[-8:-4], "little") + 8
    assert len(data) <= size
    return data[:-footer] + b"\0" * (size - len(data)) + data[-footer:]


@pytest.fixture
def converted_copy(converted_dataset: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "converted"
    shutil.copytree(converted_dataset, copy)
    return copy


def test_a_parquet_shard_swapped_for_other_rows_of_the_same_size_and_time_is_refused_at_resume_naming_footers(
    tmp_path: Path, start_serve
) -> None:
    dataset = tmp_path / "data"
    (dataset / "train").mkdir(parents=True)
    for i in range(4):
        write_plain_shard(dataset / "train" / f"part-{i}.parquet", np.arange(i * SHARD_ROWS, (i + 1) * SHARD_ROWS))
    options = ("--batch-size", "100", "--seed", "0")
    first = start_serve(dataset, *options)
    state = position_after(first.endpoint, 10)
    first.kill()
    # Ids 2173 … 4172 in place of 2000 … 3999: served on, 173 ids would come twice and 173 never.
    write_plain_shard(tmp_path / "other.parquet", np.arange(SHARD_ROWS + 173, 2 * SHARD_ROWS + 173))
    replace_keeping_time(dataset / "train" / "part-1.parquet", tmp_path / "other.parquet")
    second = start_serve(dataset, *options)
    error = resume_error(second.endpoint, state)
    assert error.differences == ["footers"]
    assert "footers is '4 files #" in str(error) and f"at tcp://127.0.0.1:{second.port}" in str(error)


def test_a_converted_shard_swapped_for_other_samples_of_the_same_size_and_time_is_refused_naming_footers(
    converted_copy: Path, tmp_path: Path, start_serve
) -> None:
    first = start_serve(converted_copy, "--batch-size", "8")
    state = position_after(first.endpoint, 2)
    first.kill()
    shard = converted_copy / "eeg" / "part-00000.parquet"
    # The same recordings, one device silent (every sample 0) in all of them: the same rows and
    # times, one row group per recording as before, so the manifest still fits; a smaller file,
    # padded to the original's size.
    original = pq.ParquetFile(shard)
    field = original.schema_arrow.field("x")
    with pq.ParquetWriter(tmp_path / "silent.parquet", original.schema_arrow, compression="lz4", use_dictionary=False,
                          column_encoding={"t": "BYTE_STREAM_SPLIT", "x": "BYTE_STREAM_SPLIT"}) as writer:
        for g in range(original.num_row_groups):
            group = original.read_row_group(g)
            zeros = pa.FixedSizeBinaryArray.from_buffers(
                field.type, group.num_rows, [None, pa.py_buffer(bytes(group.num_rows * field.type.byte_width))])
            writer.write_table(group.set_column(1, field, zeros), row_group_size=group.num_rows)
    padded = with_padding_before_footer((tmp_path / "silent.parquet").read_bytes(), shard.stat().st_size)
    (tmp_path / "padded.parquet").write_bytes(padded)
    assert pq.ParquetFile(tmp_path / "padded.parquet").read_row_group(1).equals(
        pq.ParquetFile(tmp_path / "silent.parquet").read_row_group(1))
    replace_keeping_time(shard, tmp_path / "padded.parquet")
    second = start_serve(converted_copy, "--batch-size", "8")
    error = resume_error(second.endpoint, state)
    assert error.differences == ["footers"]


def test_a_grid_file_regenerated_with_other_values_of_the_same_size_and_time_is_refused_naming_grids(
    converted_copy: Path, tmp_path: Path, start_serve
) -> None:
    first = start_serve(converted_copy, "--batch-size", "8")
    state = position_after(first.endpoint, 2)
    first.kill()
    zgrid = converted_copy / "eeg" / "zgrid-00000.arrow"  # what a server normalising with z-scores serves
    with pa.memory_map(str(zgrid)) as mapped:
        grids = [g * np.float32(1.5) for g in grid_arrays(mapped, str(zgrid))]
    writer = GridWriter(str(tmp_path / "zgrid.arrow"))
    for g in grids:
        writer.append(g)
    writer.close()
    replace_keeping_time(zgrid, tmp_path / "zgrid.arrow")
    second = start_serve(converted_copy, "--batch-size", "8")
    error = resume_error(second.endpoint, state)
    assert error.differences == ["grids"]
    assert "grids is '" in str(error)


def test_start_up_reads_footers_only_so_a_shard_with_unreadable_pages_is_fingerprinted_and_named_when_read(
    tmp_path: Path,
) -> None:
    dataset = tmp_path / "data"
    dataset.mkdir()
    for i in range(2):
        write_plain_shard(dataset / f"part-{i}.parquet", np.arange(i * SHARD_ROWS, (i + 1) * SHARD_ROWS))
    intact = ParquetSource(str(dataset)).fingerprint("train")
    assert intact["footers"].startswith("2 files #")
    # Every page of the first shard overwritten, its footer left as it was: nothing at start-up
    # reads a page, so the source starts, with the same fingerprint (which cannot see pages).
    shard = dataset / "part-0.parquet"
    data = bytearray(shard.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    data[4:-footer] = b"\xff" * (len(data) - 4 - footer)
    shard.write_bytes(bytes(data))
    source = ParquetSource(str(dataset))
    assert source.fingerprint("train") == intact
    spec = source.column_specs(("sample_id",))
    with pytest.raises(DataError, match="part-0.parquet, row group 0"):
        source.decode_unit("train", 0, spec)
    assert source.decode_unit("train", 4, spec)["sample_id"][0] == SHARD_ROWS  # the other shard reads


def test_grid_data_is_never_read_for_the_fingerprint(converted_copy: Path) -> None:
    base = WindowSource(str(converted_copy)).fingerprint("train")
    assert base["grids"].startswith("4 files #")  # eeg, ecg, gsr and video of the one shard
    # The values of a grid changed in place, its footer untouched: what a fingerprint from
    # footers cannot see, and what shows it never reads the grids.
    zgrid = converted_copy / "eeg" / "zgrid-00000.arrow"
    data = bytearray(zgrid.read_bytes())
    with pa.memory_map(str(zgrid)) as mapped:
        values = grid_arrays(mapped, str(zgrid))[0][:64].tobytes()
    start = data.find(values)
    assert start > 0
    data[start:start + len(values)] = b"\x01" * len(values)
    zgrid.write_bytes(bytes(data))
    assert WindowSource(str(converted_copy)).fingerprint("train") == base


def test_a_content_digest_tells_apart_footers_that_statistics_and_sizes_do_not(tmp_path: Path) -> None:
    """Rows reordered within their row group, uncompressed: every size, offset and statistic is
    the same, and so is the footer (the case the documentation says footers alone cannot see);
    with the digest fuelline writes into the metadata, the footers differ."""
    ids = np.arange(1000, dtype=np.int64)
    reordered = np.concatenate([np.random.default_rng(0).permutation(ids[i:i + 500]) for i in (0, 500)])
    digests: dict[bool, list[str]] = {False: [], True: []}
    for with_digest in (False, True):
        for i, values in enumerate((ids, reordered)):
            table = pa.table({"sample_id": values, "x": (values / 10).astype(np.float32)})
            if with_digest:
                content = ContentDigest()
                content.update(values, (values / 10).astype(np.float32))
                table = table.replace_schema_metadata({CONTENT_KEY: content.hexdigest()})
            path = tmp_path / f"{with_digest}-{i}.parquet"
            pq.write_table(table, path, compression="none", use_dictionary=False, row_group_size=500)
            with pa.OSFile(str(path)) as handle:
                digests[with_digest].append(read_parquet_footer(handle)[1])
    assert digests[False][0] == digests[False][1]
    assert digests[True][0] != digests[True][1]


def test_convert_stores_the_digest_of_every_shard_and_grid_in_its_footer(converted_dataset: Path) -> None:
    manifest = Manifest.load(str(converted_dataset))
    shards = {(m, p.file) for r in manifest.recordings for m, p in r.modalities.items()}
    for modality, rel in sorted(shards):
        path = converted_dataset / rel
        pf = pq.ParquetFile(path)
        expected = ContentDigest()
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g)
            x = stored_samples(table.column("x"), len(manifest.modalities[modality].channels), str(path))
            expected.update(table.column("t").to_numpy(), x)
        assert pf.metadata.metadata[CONTENT_KEY.encode()].decode() == expected.hexdigest(), rel
    grids = {f for r in manifest.recordings for p in r.modalities.values() for f in (p.grid_file, p.zgrid_file)}
    for rel in sorted(grids):
        with pa.memory_map(str(converted_dataset / rel)) as mapped:
            expected = ContentDigest()
            expected.update(*grid_arrays(mapped, rel))
            assert pa.ipc.open_file(mapped).schema.metadata[CONTENT_KEY.encode()].decode() == expected.hexdigest(), rel
