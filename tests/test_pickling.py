"""``ServerDataStream`` and ``ServerDataset`` pickle without their connections and continue at
their position; ``ServerDataStream`` takes Fuel 0.2's positional signature as well as its own."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream

TIMEOUT = 20.0
pytestmark = pytest.mark.timeout(60)


def ids(batches) -> list[tuple[int, ...]]:
    return [tuple(b[0].tolist()) for b in batches]


def reference(endpoint: str, epochs: int) -> list[list[tuple[int, ...]]]:
    with ServerDataStream(("sample_id",), endpoints=[endpoint], timeout=TIMEOUT) as stream:
        return [ids(stream.get_epoch_iterator()) for _ in range(epochs)]


def test_a_pickled_stream_continues_mid_epoch_where_it_was(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = reference(server.endpoint, 2)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
        it = stream.get_epoch_iterator()
        before = [tuple(next(it)[0].tolist()) for _ in range(7)]
        blob = pickle.dumps(stream)
    copy = pickle.loads(blob)
    try:
        assert copy.transports == []  # nothing connected until it is used
        assert copy.state_dict()["epoch"] == 0 and copy.state_dict()["cursor"] == 7
        after = ids(copy.get_epoch_iterator())
        assert before + after == expected[0]  # the rest of the epoch: nothing lost, nothing repeated
        assert ids(copy.get_epoch_iterator()) == expected[1]
    finally:
        copy.close()


def test_a_pickled_stream_keeps_its_reader_and_fingerprint(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], rank=1, world_size=2, split="val",
                          hwm=3, timeout=TIMEOUT) as stream:
        next(iter(stream))
        state = stream.state_dict()
        copy = pickle.loads(pickle.dumps(stream))
    assert (copy.rank, copy.world_size, copy.split, copy.hwm) == (1, 2, "val", 3)
    assert copy.state_dict() == state and state["fingerprint"] is not None


def test_a_pickled_dataset_continues_with_the_next_epoch(sample_dataset: Path, start_serve) -> None:
    pytest.importorskip("torch")
    from fuelline.client import ServerDataset

    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = reference(server.endpoint, 2)
    dataset = ServerDataset(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT)
    assert ids(dataset) == expected[0]
    copy = pickle.loads(pickle.dumps(dataset))
    assert ids(copy) == expected[1]


def test_fuel_positional_signature_reads_from_the_server(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    labels = {"sample_id": ("batch",)}
    # Fuel 0.2: ServerDataStream(sources, produces_examples, host, port, hwm, axis_labels)
    with ServerDataStream(("sample_id",), False, "127.0.0.1", server.port, 4, labels, timeout=TIMEOUT) as fuel:
        assert fuel.endpoint == f"tcp://{server.endpoint}" and fuel.hwm == 4
        assert fuel.axis_labels == labels and fuel.produces_examples is False
        first = next(fuel.get_epoch_iterator())
    # fuelline's own order, as before: ServerDataStream(sources, host, port, hwm)
    with ServerDataStream(("sample_id",), "127.0.0.1", server.port, 4, timeout=TIMEOUT) as own:
        assert own.hwm == 4 and own.axis_labels is None
        assert np.array_equal(next(own.get_epoch_iterator())[0], first[0])


def test_fuel_signature_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="produces_examples=True"):
        ServerDataStream(("sample_id",), True)
    with pytest.raises(TypeError, match="multiple values for argument 'port'"):
        ServerDataStream(("sample_id",), False, "127.0.0.1", 5557, port=5558)
    with pytest.raises(TypeError, match="at most 3 positional arguments"):
        ServerDataStream(("sample_id",), "127.0.0.1", 5557, 10, None)
