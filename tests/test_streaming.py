"""End to end: a real `fuelline serve` process, real sockets, ServerDataStream clients."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.client.connection import Connection
from fuelline.protocol import ServerUnavailable
from fuelline.server.sources.sample import expected_features

from support.processes import wait_until

TIMEOUT = 20.0


def read_epoch(stream: ServerDataStream) -> list[dict[str, np.ndarray]]:
    return list(stream.get_epoch_iterator(as_dict=True))


def labels_on_disk(dataset: Path, split: str = "train") -> dict[int, int]:
    table = pq.read_table(dataset / split, columns=["sample_id", "label"])
    return dict(zip(table["sample_id"].to_pylist(), table["label"].to_pylist()))


def test_one_epoch_delivers_every_row_once_with_values_intact(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "64")
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
        batches = read_epoch(stream)
        assert stream.sources == ("sample_id", "features", "label", "weight")
        assert stream.batches_per_epoch == len(batches) == 125
    ids = np.concatenate([b["sample_id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(8000))
    labels = labels_on_disk(sample_dataset)
    for b in batches:
        assert b["features"].dtype == np.float32 and b["features"].shape == (len(b["sample_id"]), 8)
        assert np.array_equal(b["features"], expected_features(b["sample_id"], 8))
        assert b["label"].tolist() == [labels[i] for i in b["sample_id"].tolist()]
        assert all(a.flags.writeable for a in b.values())


def test_tuples_follow_the_requested_sources_order(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset)
    with ServerDataStream(("label", "sample_id"), endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
        first = next(iter(stream.get_epoch_iterator()))
        assert isinstance(first, tuple) and len(first) == 2
        label, ids = first
        labels = labels_on_disk(sample_dataset)
        assert label.tolist() == [labels[i] for i in ids.tolist()]


@pytest.mark.parametrize("batch_size", ["64", "100"])
def test_two_ranks_get_disjoint_halves_with_equal_batch_counts(sample_dataset: Path, start_serve, batch_size: str) -> None:
    server = start_serve(sample_dataset, "--batch-size", batch_size)
    shares = {}
    counts = {}
    for rank in (0, 1):
        with ServerDataStream(endpoints=[server.endpoint], rank=rank, world_size=2, timeout=TIMEOUT) as s:
            batches = read_epoch(s)
            counts[rank] = len(batches)
            shares[rank] = np.concatenate([b["sample_id"] for b in batches])
    assert counts[0] == counts[1] == -(-4000 // int(batch_size))
    assert not set(shares[0].tolist()) & set(shares[1].tolist())
    assert sorted(np.concatenate([shares[0], shares[1]]).tolist()) == list(range(8000))


def test_uneven_split_is_padded_by_wrapping(tmp_path: Path, start_serve) -> None:
    from fuelline.server.sources.sample import write_sample_dataset

    data = tmp_path / "odd"
    write_sample_dataset(str(data), rows=1001, dim=2, files=3, row_group_rows=100, val_fraction=0.001)
    server = start_serve(data, "--batch-size", "32")
    shares = []
    for rank in range(3):
        with ServerDataStream(endpoints=[server.endpoint], rank=rank, world_size=3, timeout=TIMEOUT) as s:
            batches = read_epoch(s)
            shares.append(np.concatenate([b["sample_id"] for b in batches]))
    total = 1000
    assert {len(s) for s in shares} == {334}  # ceil(1000 / 3)
    together = np.concatenate(shares)
    assert set(together.tolist()) == set(range(total))
    _, dup = np.unique(together, return_counts=True)
    assert int((dup - 1).sum()) == 3 * 334 - total  # padding is the only duplication


def order_of(endpoint: str, epochs: int = 1) -> list[list[int]]:
    with ServerDataStream(("sample_id",), endpoints=[endpoint], timeout=TIMEOUT) as s:
        return [np.concatenate([b[0] for b in s.get_epoch_iterator()]).tolist() for _ in range(epochs)]


def test_same_seed_gives_the_same_order_twice(sample_dataset: Path, start_serve) -> None:
    a = start_serve(sample_dataset, "--seed", "5")
    b = start_serve(sample_dataset, "--seed", "5")
    c = start_serve(sample_dataset, "--seed", "6")
    first = order_of(a.endpoint, epochs=2)
    assert first == order_of(b.endpoint, epochs=2)  # another process, same order
    assert first == order_of(a.endpoint, epochs=2)  # another client, same order
    assert first[0] != first[1]  # each epoch is shuffled anew
    assert first[0] != order_of(c.endpoint)[0]


def test_no_shuffle_serves_storage_order(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--no-shuffle")
    assert order_of(server.endpoint)[0] == list(range(8000))


def test_val_split_is_served_by_the_same_server(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], split="val", timeout=TIMEOUT) as s:
        ids = np.concatenate([b[0] for b in s.get_epoch_iterator()])
        assert s.info["split"] == "val" and s.info["rows"] == 2000
    assert sorted(ids.tolist()) == list(range(8000, 10000))


def test_client_without_server_raises_within_its_timeout() -> None:
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago, with nothing behind it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stream = ServerDataStream(port=port, host="127.0.0.1", timeout=1.5, heartbeat=0.2)
    started = time.monotonic()
    with pytest.raises(ServerUnavailable) as info:
        next(iter(stream.get_epoch_iterator()))
    waited = time.monotonic() - started
    stream.close()
    assert 1.5 <= waited < 5.0
    assert f"127.0.0.1:{port}" in str(info.value) and "no answer" in str(info.value)


def test_sigterm_stops_server_with_exit_0_and_client_is_told(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "8", "--heartbeat", "0.2")
    stream = ServerDataStream(endpoints=[server.endpoint], hwm=2, timeout=2.0, heartbeat=0.2)
    it = stream.get_epoch_iterator()
    next(it)
    server.wait_log(r"client \S+: rank 0 of 1")
    assert server.terminate() == 0
    assert "server stopped: server shutting down (SIGTERM)" in server.log()
    started = time.monotonic()
    with pytest.raises(ServerUnavailable) as info:
        for _ in it:  # the two prefetched batches may still arrive; then the client gives up
            pass
    stream.close()
    assert "said: server shutting down (SIGTERM)" in str(info.value)
    assert time.monotonic() - started < 10.0


def test_sigterm_just_after_clients_leave_stops_at_once_and_logs_no_error(sample_dataset: Path, start_serve) -> None:
    """A client that leaves at once (its session's producer still starting its first decodes),
    then SIGTERM: the server joins that producer before closing the source under it. A lock
    taken in the wrong order there once hung one server in ten for good."""
    for attempt in range(6):
        server = start_serve(sample_dataset, "--batch-size", "8")
        with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
            assert stream.info["rows"] > 0
        assert server.terminate(timeout=10.0) == 0, attempt  # (raises if SIGTERM is ignored)
        log = server.log()
        assert "server stopped: server shutting down (SIGTERM)" in log, attempt
        assert " ERROR " not in log and "Traceback" not in log, log


def test_state_dict_resumes_the_same_sequence_in_a_new_client(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "50")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        whole = [b[0].tolist() for b in s.get_epoch_iterator()] + [b[0].tolist() for b in s.get_epoch_iterator()]
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        seen = [next(it)[0].tolist() for _ in range(37)]
        state = s.state_dict()
    assert state["epoch"] == 0 and state["cursor"] == 37
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        s.load_state_dict(state)
        seen += [b[0].tolist() for b in s.get_epoch_iterator()]
        assert s.state_dict()["epoch"] == 1 and s.state_dict()["cursor"] == 0
        seen += [b[0].tolist() for b in s.get_epoch_iterator()]
    assert seen == whole  # nothing lost, nothing repeated


def test_abandoned_epoch_moves_on_to_the_next_as_fuel_does(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    full = order_of(server.endpoint, epochs=2)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
        it = s.get_epoch_iterator()
        assert next(it)[0].tolist() == full[0][:100]
        second = np.concatenate([b[0] for b in s.get_epoch_iterator()]).tolist()
        assert list(it) == []  # the abandoned iterator yields nothing more
    assert second == full[1]


def test_torch_tensors_share_memory_with_the_received_frames(sample_dataset: Path, start_serve) -> None:
    torch = pytest.importorskip("torch")
    server = start_serve(sample_dataset)
    with ServerDataStream(endpoints=[server.endpoint], tensors=True, timeout=TIMEOUT) as s:
        batch = next(iter(s.get_epoch_iterator(as_dict=True)))
    feats = batch["features"]
    assert isinstance(feats, torch.Tensor) and feats.dtype == torch.float32
    assert torch.equal(feats, torch.from_numpy(expected_features(batch["sample_id"].numpy(), 8)))
    feats.add_(1.0)  # writable in place, no copy was needed to make it so
    assert batch["label"].dtype == torch.int64


def test_many_clients_at_once_each_get_a_full_epoch(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "128")
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = order_of(server.endpoint)[0]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 6
    assert all(r == results[0] for r in results.values())
    assert sorted(results[0]) == list(range(8000))


@pytest.mark.parametrize("hwm", [1, 3, 10])
def test_long_stream_of_small_batches_never_stalls(sample_dataset: Path, start_serve, hwm: int) -> None:
    # Thousands of credit round trips: a lost wake-up between the user's thread and the client's
    # I/O thread (or the server's producer and loop) would leave the stream waiting forever.
    server = start_serve(sample_dataset, "--batch-size", "4")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=hwm, timeout=TIMEOUT, receive_timeout=10) as s:
        for _ in range(2):
            ids = np.concatenate([b[0] for b in s.get_epoch_iterator()])
            assert sorted(ids.tolist()) == list(range(8000))


def test_batches_are_decoded_ahead_while_the_user_is_busy(sample_dataset: Path, start_serve) -> None:
    """While the user trains, the keep-alive thread takes in, decodes and checks what has arrived,
    so the next batch is ready when asked for; without that, it would only wake every quarter
    heartbeat (2.5 s here), long after the deadline below."""
    server = start_serve(sample_dataset, "--batch-size", "64", "--hwm", "4")
    with ServerDataStream(endpoints=[server.endpoint], timeout=TIMEOUT, heartbeat=10.0, hwm=4) as stream:
        it = stream.get_epoch_iterator(as_dict=True)
        first = next(it)
        conn = stream._conns[0]
        deadline = time.monotonic() + 1.5
        ready = 0
        while time.monotonic() < deadline:  # the user "training", looking in now and then
            ready = len(conn._items)
            if ready >= 2:
                break
            threading.Event().wait(0.01)
        assert ready >= 2, f"{ready} batches decoded ahead after 1.5 s"
        rest = list(it)
    ids = np.concatenate([first["sample_id"], *(b["sample_id"] for b in rest)])
    assert sorted(ids.tolist()) == list(range(8000))  # nothing lost or repeated on the way


# A Fuel-style stream whose batches come one every 10 ms, to a client that has credit for them all.
TRICKLE_SERVER = """
import time
import numpy as np
from fuelline.server import start_server

class Trickle:
    sources = ("x",)

    def get_epoch_iterator(self, **kwargs):
        for i in range(100_000):
            time.sleep(0.01)
            yield (np.full((4, 4), i, np.float32),)

start_server(Trickle(), port=0, hwm=64, heartbeat=10.0)
"""


def test_the_keepalive_thread_wakes_for_what_arrives_not_on_a_timer(start_script, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the user trains, the keep-alive thread takes in each batch as it arrives: about a turn
    a batch, and one every ``READ_AHEAD_IDLE`` at most besides. Each turn takes the interpreter lock
    from a training step that holds it; a thread that polled on a timer (every half millisecond
    after a batch, backing off) took four or five turns a batch here."""
    turns: list[float] = []
    step = Connection._step

    def counted(self: Connection, wait: float, limit: int | None = None) -> None:
        if threading.current_thread().name.startswith("fuelline-keepalive-"):
            turns.append(time.monotonic())
        step(self, wait, limit)

    monkeypatch.setattr(Connection, "_step", counted)
    server = start_script(TRICKLE_SERVER)
    with ServerDataStream(("x",), port=server.port, hwm=64, heartbeat=10.0, timeout=TIMEOUT,
                          receive_timeout=TIMEOUT) as stream:
        it = stream.get_epoch_iterator()
        next(it)
        (conn,) = stream._conns
        # The user "trains": it takes nothing while 40 batches arrive.
        received, taken = conn._messages, len(turns)
        took = wait_until(lambda: conn._messages - received >= 40, TIMEOUT, "40 batches while the user trains")
        arrived, turned = conn._messages - received, len(turns) - taken
        ready = len(conn._items)
        assert ready >= 40, f"only {ready} of the batches that arrived were taken in while the user trained"
        first = next(it)
    assert first[0].shape == (4, 4)
    assert turned <= 2 * arrived + took / Connection.READ_AHEAD_IDLE, (
        f"{turned} keep-alive turns for {arrived} batches in {took:.2f}s")
