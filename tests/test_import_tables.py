"""From what users have to served batches: ``write_dataset`` and ``fuelline import`` on a dataset
that ships with scikit-learn (digits) as a pandas DataFrame, a CSV file, a Hugging Face Dataset
and the folder ``save_to_disk`` writes, served by a real ``fuelline serve`` and read back; the
mistakes users make get one line naming the column, the row or the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError, OptionError
from fuelline.server.ingest.tables import write_dataset
from fuelline.server.sources.parquet import ParquetSource

pd = pytest.importorskip("pandas", reason="pandas is in the dev extra")
datasets_lib = pytest.importorskip("datasets", reason="datasets is in the dev extra")
load_digits = pytest.importorskip("sklearn.datasets", reason="scikit-learn is in the dev extra").load_digits

TIMEOUT = 20.0
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def digits() -> "pd.DataFrame":
    """1,797 rows: 64 float64 pixel columns (pixel_0_0 … pixel_7_7) and an int64 target."""
    return load_digits(as_frame=True).frame


def read_split(port: int, split: str, sources: tuple[str, ...]) -> dict[str, np.ndarray]:
    """One epoch of a split from a server, its batches joined per source."""
    with ServerDataStream(sources, host="127.0.0.1", port=port, split=split, rank=0, world_size=1,
                          timeout=TIMEOUT) as stream:
        batches = list(stream.get_epoch_iterator())
        info = dict(stream.info)
    joined = {s: np.concatenate([b[i] for b in batches]) for i, s in enumerate(sources)}
    joined["_batch_shapes"] = [b[0].shape for b in batches]  # type: ignore[assignment]
    joined["_info"] = info  # type: ignore[assignment]
    return joined


def test_a_dataframe_is_served_as_one_image_source_its_rows_each_once_and_unchanged(
    tmp_path: Path, digits, start_serve
) -> None:
    """The digits frame, grouped into an 8×8 image: every row once across train and val (by the
    sample ids made from row positions), each row's pixels the frame's as float32, the label
    stratified into val, and the server's info giving the label's counts per class."""
    out = tmp_path / "digits"
    summary = write_dataset(digits, out, label="target", group={"image": ("pixel_*", (8, 8))}, val_fraction=0.2)
    assert summary.made_sample_id and summary.sources["image"] == "float32 [8, 8]"
    server = start_serve(out, "--batch-size", "64")
    pixels = digits.filter(like="pixel_").to_numpy().astype(np.float32).reshape(-1, 8, 8)
    seen = []
    for split in ("train", "val"):
        got = read_split(server.port, split, ("image", "target", "sample_id"))
        ids = got["sample_id"]
        assert len(np.unique(ids)) == len(ids)
        assert got["image"].dtype == np.float32 and got["image"].shape[1:] == (8, 8)
        assert np.array_equal(got["image"], pixels[ids]), split
        assert np.array_equal(got["target"], digits["target"].to_numpy()[ids]), split
        assert all(shape[0] <= 64 for shape in got["_batch_shapes"])
        info = got["_info"]
        counts = np.bincount(got["target"], minlength=10)
        assert info["label"] == "target"
        assert info["class_names"] == [str(c) for c in range(10)]
        assert info["class_counts"] == {str(c): int(n) for c, n in enumerate(counts)}
        seen.append(ids)
    every = np.concatenate(seen)
    assert sorted(every.tolist()) == list(range(len(digits)))
    # Stratified: each class's share in val is 0.2 of its rows, rounded.
    val = np.isin(np.arange(len(digits)), seen[1])
    for c in range(10):
        rows = (digits["target"] == c).to_numpy()
        assert val[rows].sum() == round(rows.sum() * 0.2), c


def test_the_rows_are_shuffled_once_so_a_sorted_input_mixes_in_every_row_group(tmp_path: Path, digits) -> None:
    """A frame sorted by class is written shuffled (seeded): every row group of train holds
    several classes, the same seed writes the same files, and --no-shuffle keeps the order."""
    ordered = digits.sort_values("target", kind="stable").reset_index(drop=True)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out in (a, b):
        write_dataset(ordered, out, label="target", group={"features": "pixel_*"}, seed=3, rows_per_group=200)
    write_dataset(ordered, c, label="target", group={"features": "pixel_*"}, seed=3, rows_per_group=200, shuffle=False)
    files = sorted((a / "train").glob("*.parquet"))
    assert [f.read_bytes() for f in files] == [f.read_bytes() for f in sorted((b / "train").glob("*.parquet"))]
    table = pq.ParquetFile(files[0])
    assert table.num_row_groups >= 5
    for g in range(table.num_row_groups):
        assert len(np.unique(table.read_row_group(g, columns=["target"]).column(0).to_numpy())) >= 5, g
    first = pq.ParquetFile(sorted((c / "train").glob("*.parquet"))[0]).read_row_group(0, columns=["target"])
    assert len(np.unique(first.column(0).to_numpy())) <= 2


def test_list_columns_of_one_length_become_sources_of_that_shape_and_ragged_ones_name_the_row(tmp_path: Path) -> None:
    """A column of lists (as users build a DataFrame of embeddings) is a fixed-shape source; one
    row of another length is refused naming the column and the row, and nothing is left."""
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"emb": [rng.random(5).tolist() for _ in range(40)],
                          "grid": [rng.random((2, 3)).tolist() for _ in range(40)],
                          "y": ["cat", "dog", "cow", "cat"] * 10})
    summary = write_dataset(frame, tmp_path / "ok", label="y", val_fraction=0)
    assert summary.sources == {"emb": "float32 [5]", "grid": "float32 [2, 3]", "y": "int64 (one per row)",
                               "sample_id": "int64 (one per row)"}
    assert summary.classes == ["cat", "cow", "dog"]
    src = ParquetSource(str(tmp_path / "ok"))
    assert src.schema()["grid"]["shape"] == [2, 3]
    assert src.info("train")["class_counts"] == {"cat": 20, "cow": 10, "dog": 10}
    ragged = frame.copy()
    ragged.at[7, "emb"] = [1.0, 2.0]
    with pytest.raises(DataError, match=r"column 'emb' holds lists of 2 to 5 values \(row 7 has 2, row 0 5\)"):
        write_dataset(ragged, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_what_cannot_be_served_is_named_with_the_fix(tmp_path: Path) -> None:
    """A text column, duplicate sample ids, a float label, ragged numpy objects and a group that
    matches nothing: each a one-line error naming the column or option; drop= leaves text out."""
    frame = pd.DataFrame({"x": np.arange(10.0), "name": list("abcdefghij"), "sample_id": [1] * 10})
    with pytest.raises(DataError, match=r"column 'name' has type (large_)?string.*drop=\['name'\]"):
        write_dataset(frame, tmp_path / "a")
    with pytest.raises(DataError, match=r"column 'sample_id': id 1 is on 10 rows"):
        write_dataset(frame, tmp_path / "b", drop=["name"])
    summary = write_dataset(frame, tmp_path / "c", drop=["name"], sample_id="row")
    assert summary.dropped == ["name"] and "row" in summary.sources
    with pytest.raises(DataError, match=r"label column 'x' has type double: class labels are integers or strings"):
        write_dataset(frame.assign(x=np.arange(10) + 0.5), tmp_path / "d", label="x", drop=["name"], sample_id="r")
    with pytest.raises(DataError, match=r"array 'x' holds Python objects"):
        write_dataset({"x": np.array([np.zeros(2), np.zeros(3)], dtype=object)}, tmp_path / "e")
    with pytest.raises(OptionError, match=r"'pix\*' matches no column"):
        write_dataset(frame, tmp_path / "f", group={"features": "pix*"}, drop=["name"], sample_id="r")
    assert not any((tmp_path / n).exists() for n in "abdef")


def test_a_hugging_face_dataset_and_its_saved_folder_keep_their_splits(tmp_path: Path, digits, start_serve) -> None:
    """A DatasetDict (train / validation) is written with its splits, ``validation`` named val;
    the folder ``save_to_disk`` wrote gives the same served rows, and a shuffled view of a
    Dataset gives its rows in the view's order."""
    hf = datasets_lib.Dataset.from_pandas(digits)
    splits = hf.train_test_split(test_size=0.25, seed=0)
    dd = datasets_lib.DatasetDict({"train": splits["train"], "validation": splits["test"]})
    write_dataset(dd, tmp_path / "from-object", label="target", group={"features": "pixel_*"}, shuffle=False)
    dd.save_to_disk(str(tmp_path / "saved"))
    write_dataset(tmp_path / "saved", tmp_path / "from-disk", label="target", group={"features": "pixel_*"},
                  shuffle=False)
    for out in ("from-object", "from-disk"):
        src = ParquetSource(str(tmp_path / out))
        assert src.splits == ["train", "val"] or sorted(src.splits) == ["train", "val"], out
        assert src.info("val")["rows"] == len(splits["test"])
    server = start_serve(tmp_path / "from-disk", "--no-shuffle", "--batch-size", "100")
    got = read_split(server.port, "val", ("features", "target"))
    expected = np.asarray(splits["test"].with_format("numpy")[:]["pixel_0_3"], dtype=np.float32)
    assert np.array_equal(got["features"][:, 3], expected)
    view = hf.select([5, 3, 1])
    write_dataset(view, tmp_path / "view", val_fraction=0, shuffle=False, group={"features": "pixel_*"})
    table = pq.read_table(tmp_path / "view" / "train")
    assert table.column("target").to_pylist() == digits["target"].iloc[[5, 3, 1]].tolist()


def test_fuelline_import_from_csv_then_inspect_says_what_will_be_served(tmp_path: Path, digits) -> None:
    """The command line: a CSV of the digits frame to a dataset, ``fuelline inspect --json``
    listing the grouped source, the label's counts and no advice; a plain ``to_parquet`` of the
    frame gets advice naming the fix; a bad --group is one line and exit status 2."""
    csv = tmp_path / "digits.csv"
    digits.to_csv(csv, index=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fuelline = [sys.executable, "-m", "fuelline.server.cli"]
    done = subprocess.run([*fuelline, "import", str(csv), str(tmp_path / "ds"), "--label", "target",
                           "--group", "image=pixel_*:8x8"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "source image: float32 [8, 8]" in done.stdout and f"fuelline serve {tmp_path / 'ds'}" in done.stdout
    report = json.loads(subprocess.run([*fuelline, "inspect", str(tmp_path / "ds"), "--json"], capture_output=True,
                                       text=True, timeout=60, env=env, check=True).stdout)
    assert report["sources"]["image"] == {"dtype": "<f4", "shape": [8, 8]}
    assert sum(report["splits"]["train"]["class_counts"].values()) == report["splits"]["train"]["rows"]
    assert report["advice"] == []
    digits.to_parquet(tmp_path / "plain.parquet", index=True)
    plain = json.loads(subprocess.run([*fuelline, "inspect", str(tmp_path / "plain.parquet"), "--json"],
                                      capture_output=True, text=True, timeout=60, env=env, check=True).stdout)
    assert any("--group" in line for line in plain["advice"]), plain["advice"]
    assert any("no sample_id" in line for line in plain["advice"])
    bad = subprocess.run([*fuelline, "import", str(csv), str(tmp_path / "bad"), "--group", "image=pixel_*:8x9"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["fuelline import: error: --group image: 64 columns do not make shape 8x9"]
    assert not (tmp_path / "bad").exists()
    typo = subprocess.run([*fuelline, "import", str(csv), str(tmp_path / "typo"), "--label", "tagret"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert typo.returncode == 2
    assert typo.stderr.strip().splitlines() == [
        "fuelline import: error: --label input has no column 'tagret' (did you mean 'target'?)"]


def test_a_dict_of_numpy_arrays_keeps_each_arrays_shape(tmp_path: Path) -> None:
    """``{"x": (N, 3, 4) float32, "y": (N,) int}``: x served as [3, 4], rows unchanged."""
    x = np.random.default_rng(1).random((300, 3, 4)).astype(np.float32)
    y = np.arange(300) % 3
    write_dataset({"x": x, "y": y}, tmp_path / "d", label="y", shuffle=False, val_fraction=0)
    table = pq.read_table(tmp_path / "d" / "train")
    src = ParquetSource(str(tmp_path / "d"))
    assert src.schema()["x"] == {"dtype": "<f4", "shape": [3, 4]}
    got = np.asarray(table.column("x").combine_chunks().flatten().flatten()).reshape(300, 3, 4)
    assert np.array_equal(got, x)
    assert isinstance(table.schema.field("x").type, pa.FixedSizeListType)


def test_the_trainer_takes_the_label_and_its_classes_the_dataset_names(tmp_path: Path) -> None:
    """A string label written by ``write_dataset`` reaches the trainer's class facts through the
    server's info: names in class-index order and train rows per class, with no pass over the
    labels; a --label-source other than the recorded label gets none of them."""
    pytest.importorskip("torch")
    from fuelline.trainer.model_spec import class_facts

    frame = pd.DataFrame({"x": np.arange(60.0), "kind": ["b", "a", "c"] * 20})
    write_dataset(frame, tmp_path / "d", label="kind", val_fraction=0.25)
    info = ParquetSource(str(tmp_path / "d")).info("train")
    assert info["label"] == "kind"

    def no_scan() -> int:
        raise AssertionError("the labels were scanned although the server named the classes")

    assert class_facts(info, None, no_scan, "kind") == (("a", "b", "c"), 3, [15, 15, 15])
    assert class_facts(info, None, lambda: 7, "x")[:2] == (None, 7)


def test_label_metadata_that_lies_is_ignored_and_never_stops_the_server(tmp_path: Path) -> None:
    """A file whose footer carries our key with nonsense (counts that are not numbers, classes
    that are not a list, not JSON at all) is served as if it had none: the label facts are bad
    input to leave out, not a reason to refuse the dataset."""
    table = pa.table({"x": np.arange(10.0), "y": np.arange(10) % 2})
    lies = [b'{"label": "y", "counts": {"cat": 1}}', b'{"label": "y", "classes": "ab", "counts": {"0": 5}}',
            b'{"label": 7}', b"not json", b'[1, 2]', b'{"label": "y", "counts": {"0": "many"}}',
            b'{"label": "y", "counts": {"999999999999": 1}}']
    for i, lie in enumerate(lies):
        folder = tmp_path / f"d{i}" / "train"
        folder.mkdir(parents=True)
        pq.write_table(table.replace_schema_metadata({b"fuelline.table": lie}), folder / "part.parquet")
        info = ParquetSource(str(tmp_path / f"d{i}")).info("train")
        assert "class_names" not in info, (lie, info)
        assert info.get("class_counts") in (None, {"999999999999": 1}), (lie, info)


def test_a_label_of_many_classes_still_lets_clients_connect(tmp_path: Path, start_serve) -> None:
    """A label with 20,000 string classes (an id column taken for a label): its names and counts
    would not fit a Welcome's header limit, so the server leaves them out of its info, and a
    client is welcomed and reads."""
    frame = pd.DataFrame({"x": np.arange(20_000.0), "who": [f"person-{i:05d}" for i in range(20_000)]})
    write_dataset(frame, tmp_path / "d", label="who", val_fraction=0)
    server = start_serve(tmp_path / "d", "--batch-size", "500")
    got = read_split(server.port, "train", ("x", "who"))
    assert len(got["x"]) == 20_000
    assert "class_names" not in got["_info"] and got["_info"]["label"] == "who"
