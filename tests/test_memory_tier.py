"""The memory tier: a client that reconnects gets its recent batches again without recomputation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zmq

from fuelline.protocol import Batch, Bye, Credit, Hello
from fuelline.server.cache.memory import RecentBatches, Remembered
from fuelline.server.serving.server import Server
from fuelline.server.sources.parquet import ParquetSource

from support.processes import wait_until
from support.raw_client import RawClient


@pytest.fixture
def server(sample_dataset: Path):
    source = ParquetSource(str(sample_dataset), batch_size=10, seed=1)
    server = Server(source, port=0, hwm=4, heartbeat=5.0, memory_cache=10)
    endpoint = server.start()
    server.address = endpoint.removeprefix("tcp://")
    yield server
    server.stop()
    server.join(10)
    source.close()


def batches(client: RawClient, n: int, ack: bool = False) -> list[Batch]:
    """The next n batches; with ``ack``, each is taken at once (its credit returned)."""
    got = []
    while len(got) < n:
        msg = client.recv()
        if isinstance(msg, Batch):
            got.append(msg)
            if ack:
                client.send(Credit(1))
    return got


def test_a_reconnecting_client_gets_its_batches_from_memory(server: Server, zmq_context: zmq.Context) -> None:
    first = RawClient(zmq_context, server.address)
    first.send(Hello("trainer-0", credit=4, heartbeat=5.0))
    assert first.recv().TYPE == "welcome"
    sent = batches(first, 4)  # hwm 4: four in flight, four more prepared behind them
    wait_until(lambda: server.recent.misses >= 8, 10.0, "the session prepared 4 batches ahead")
    prepared = server.recent.misses
    # The connection dies with batches 1-3 received by nobody: the client asks again from batch 1.
    second = RawClient(zmq_context, server.address)
    second.send(Hello("trainer-0", cursor=1, credit=4, heartbeat=5.0, stream=1))
    assert second.recv().TYPE == "welcome"
    again = batches(second, 12, ack=True)
    assert [b.seq for b in again] == list(range(1, 13))
    for old, new in zip(sent[1:], again):
        for name in old.arrays:
            np.testing.assert_array_equal(old.arrays[name], new.arrays[name])
    # Batches 1..7 came from memory (and an eighth, if the old session had prepared one more
    # before it was replaced); only the rest was prepared again.
    hits = server.recent.hits
    assert prepared - 1 <= hits <= 8
    assert server.counters()["cache_memory_hits"] == hits


def test_another_request_or_a_bye_starts_afresh(server: Server, zmq_context: zmq.Context) -> None:
    a = RawClient(zmq_context, server.address)
    a.send(Hello("trainer-1", credit=4, heartbeat=5.0))
    batches(a, 4)
    b = RawClient(zmq_context, server.address)  # the same client, now as rank 1 of 2: other batches
    b.send(Hello("trainer-1", rank=1, world_size=2, credit=4, heartbeat=5.0, stream=1))
    batches(b, 4)
    assert server.recent.hits == 0
    b.send(Bye("done"))
    wait_until(lambda: server.recent.batches() == 0, 10.0, "the client that said bye is forgotten")


def test_the_memory_tier_is_bounded_per_client_and_in_clients() -> None:
    recent = RecentBatches(k=3, max_clients=2)
    for client in ("a", "b", "c"):
        for seq in range(5):
            recent.put(client, "req", 0, seq, Remembered({"x": np.arange(seq)}, None))
    assert recent.batches() == 6  # 3 each, for the 2 most recent clients
    assert recent.get("a", "req", 0, 4) is None  # the oldest client went first
    assert recent.get("c", "req", 0, 1) is None and recent.get("c", "req", 0, 2) is not None
    assert recent.get("c", "other request", 0, 3) is None
    assert (recent.hits, recent.misses) == (1, 15)


class Recorded:
    """A Fuel-style stream that keeps every array it yields, so the test can change one later,
    as a stream that promised fresh arrays and reuses them after all would."""

    sources = ("x",)

    def __init__(self) -> None:
        self.yielded: list[np.ndarray] = []

    def get_epoch_iterator(self, **kwargs):
        for i in range(40):
            array = np.full(4, i, dtype=np.int64)
            self.yielded.append(array)
            yield (array,)


def test_a_batch_changed_after_it_was_sent_is_prepared_again(zmq_context: zmq.Context, caplog) -> None:
    from fuelline.server.sources.fuel import FuelStreamSource

    stream = Recorded()
    # Served without the server's copy, so the stream's later write reaches what the server keeps.
    server = Server(FuelStreamSource(stream, fresh_arrays=True), port=0, hwm=4, heartbeat=5.0, memory_cache=10)
    address = server.start().removeprefix("tcp://")
    try:
        first = RawClient(zmq_context, address)
        first.send(Hello("fuel-0", credit=4, heartbeat=5.0))
        assert first.recv().TYPE == "welcome"
        assert [b.arrays["x"][0] for b in batches(first, 4)] == [0, 1, 2, 3]
        wait_until(lambda: server.recent.misses >= 8, 10.0, "the session prepared 4 batches ahead")
        stream.yielded[2][:] = -1  # batch 2, sent and kept, is overwritten by its stream
        second = RawClient(zmq_context, address)
        second.send(Hello("fuel-0", cursor=1, credit=4, heartbeat=5.0, stream=1))
        assert second.recv().TYPE == "welcome"
        assert [b.arrays["x"][0] for b in batches(second, 6, ack=True)] == [1, 2, 3, 4, 5, 6]
        assert "batch 0:2 changed after it was sent" in caplog.text
        assert server.recent.hits == 1  # batch 1 came from memory; 2 on were prepared again
    finally:
        server.stop()
        server.join(10)
