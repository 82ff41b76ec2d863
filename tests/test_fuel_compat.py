"""start_server(data_stream, port, hwm) serves any Fuel-style stream, as Fuel did."""

from __future__ import annotations

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import RemoteError

TIMEOUT = 20.0

# A Fuel-style stream: `.sources` and `.get_epoch_iterator()` yielding tuples in sources order.
FUEL_SERVER = """
import numpy as np
from fuelline.server import start_server

class Stream:
    sources = ("features", "targets")

    def __init__(self, batches):
        self.batches = batches

    def get_epoch_iterator(self, **kwargs):
        for i in range(self.batches):
            yield (np.full((4, 3), i, dtype=np.float32), np.arange(4, dtype=np.int64) + 4 * i)

start_server({stream}, port=0, hwm=3)
"""


def test_fuel_stream_is_served_whole_in_order(start_script) -> None:
    server = start_script(FUEL_SERVER.format(stream="Stream(10)"))
    with ServerDataStream(("features", "targets"), port=server.port, host="127.0.0.1", timeout=TIMEOUT) as s:
        for _epoch in range(2):
            batches = list(s.get_epoch_iterator())
            assert len(batches) == 10
            for i, (features, targets) in enumerate(batches):
                assert features.shape == (4, 3) and np.all(features == i)
                assert targets.tolist() == list(range(4 * i, 4 * i + 4))
        assert s.batches_per_epoch is None  # a generic stream cannot say in advance


def test_fuel_stream_is_sharded_round_robin_with_padding(start_script) -> None:
    server = start_script(FUEL_SERVER.format(stream="Stream(7)"))
    seen = {}
    for rank in range(3):
        with ServerDataStream(("features",), port=server.port, host="127.0.0.1", rank=rank, world_size=3, timeout=TIMEOUT) as s:
            seen[rank] = [int(b[0][0, 0]) for b in s.get_epoch_iterator()]
    # Batches 0..6 round-robin over 3 ranks; ranks 1 and 2 are one short and wrap to batches 0, 1.
    assert seen == {0: [0, 3, 6], 1: [1, 4, 0], 2: [2, 5, 1]}


def test_fuel_stream_resumes_at_a_cursor(start_script) -> None:
    server = start_script(FUEL_SERVER.format(stream="Stream(9)"))
    with ServerDataStream(("features",), port=server.port, host="127.0.0.1", timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        assert [int(next(it)[0][0, 0]) for _ in range(4)] == [0, 1, 2, 3]
        state = s.state_dict()
    with ServerDataStream(("features",), port=server.port, host="127.0.0.1", timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        assert [int(b[0][0, 0]) for b in s.get_epoch_iterator()] == [4, 5, 6, 7, 8]


def test_splits_as_a_mapping_of_streams(start_script) -> None:
    server = start_script(FUEL_SERVER.format(stream='{"train": Stream(5), "valid": Stream(2)}'))
    with ServerDataStream(port=server.port, host="127.0.0.1", split="valid", timeout=TIMEOUT) as s:
        assert len(list(s.get_epoch_iterator())) == 2
        assert s.sources == ("features", "targets")
    with pytest.raises(RemoteError) as info:
        with ServerDataStream(port=server.port, host="127.0.0.1", split="test", timeout=TIMEOUT) as s:
            next(iter(s.get_epoch_iterator()))
    assert info.value.code == "unknown-split"
    assert "'test'" in str(info.value) and "train" in str(info.value) and "valid" in str(info.value)


def test_stream_with_wrong_tuple_length_is_reported_to_the_client(start_script) -> None:
    code = FUEL_SERVER.replace(
        "yield (np.full((4, 3), i, dtype=np.float32), np.arange(4, dtype=np.int64) + 4 * i)",
        "yield (np.zeros(2),) if i == 2 else (np.zeros(2), np.zeros(2))",
    )
    server = start_script(code.format(stream="Stream(5)"))
    with ServerDataStream(port=server.port, host="127.0.0.1", timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        next(it), next(it)
        with pytest.raises(RemoteError) as info:
            next(it)
    assert info.value.code == "data"
    assert "batch 2 of the stream has 1 values for 2 sources" in str(info.value)


def test_receive_timeout_tells_a_stuck_source_from_a_dead_server(start_script) -> None:
    from fuelline.protocol import ReceiveTimeout

    code = FUEL_SERVER.replace(
        "        for i in range(self.batches):\n",
        "        for i in range(self.batches):\n            if i == 2:\n                threading.Event().wait(60)\n",
    ).replace("import numpy as np\n", "import threading\nimport numpy as np\n", 1)
    server = start_script(code.format(stream="Stream(5)"))
    with ServerDataStream(
        port=server.port, host="127.0.0.1", timeout=TIMEOUT, heartbeat=0.2, receive_timeout=1.0
    ) as s:
        it = s.get_epoch_iterator()
        next(it), next(it)
        import time

        started = time.monotonic()
        with pytest.raises(ReceiveTimeout) as info:
            next(it)  # the server is alive (heartbeats) but its stream is stuck
        assert 1.0 <= time.monotonic() - started < 3.0
    assert f"127.0.0.1:{server.port}" in str(info.value)


def test_a_fuel_stream_is_fingerprinted_without_being_read(start_script) -> None:
    code = FUEL_SERVER.replace(
        "    def get_epoch_iterator(self, **kwargs):\n",
        "    calls = 0\n\n    def get_epoch_iterator(self, **kwargs):\n        Stream.calls += 1\n",
    ).replace("np.full((4, 3), i, dtype=np.float32)", "np.full((4, 3), Stream.calls, dtype=np.float32)")
    server = start_script(code.format(stream='{"train": Stream(3), "valid": Stream(2)}'))
    with ServerDataStream(("features",), port=server.port, host="127.0.0.1", timeout=TIMEOUT) as s:
        first = [int(b[0][0, 0]) for b in s.get_epoch_iterator()]
        fingerprint = s.state_dict()["fingerprint"]
    assert first == [1, 1, 1]  # the Welcome's fingerprint and schema called nothing of the stream
    assert fingerprint == {
        "kind": "fuel-stream", "split": "train", "stream": "__main__.Stream", "sources": "features,targets",
        "splits": "train,valid",
    }


def test_ranks_of_a_fuel_stream_share_one_call_per_epoch(start_script) -> None:
    code = FUEL_SERVER.replace(
        "    def get_epoch_iterator(self, **kwargs):\n",
        "    calls = 0\n\n    def get_epoch_iterator(self, **kwargs):\n        Stream.calls += 1\n",
    ).replace("np.full((4, 3), i, dtype=np.float32)", "np.full((4, 3), Stream.calls, dtype=np.float32)")
    server = start_script(code.format(stream="Stream(6)"))
    calls = {}
    for rank in range(3):
        with ServerDataStream(("features",), port=server.port, host="127.0.0.1", rank=rank, world_size=3,
                              timeout=TIMEOUT) as s:
            calls[rank] = [[int(b[0][0, 0]) for b in s.get_epoch_iterator()] for _ in range(2)]
    assert calls == {rank: [[1, 1], [2, 2]] for rank in range(3)}  # one call per epoch, whoever reads
