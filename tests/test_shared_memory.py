"""Batches placed in shared memory for a client on the server's host: the same batches as the
socket gives, memory reused only once the user lets a batch go, bounded, removed with the session,
and a header that lies gets a clear error."""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

import fuelline.client.connection as connection
from fuelline.client import ServerDataStream
from fuelline.client.slabs import ClientSlabs
from fuelline.protocol import VERSION, ArrayMeta, Credit, ProtocolError, decode, encode
from fuelline.protocol.placement import Placement
from fuelline.server.serving.local_ipc import default_base, on_memory_fs
from fuelline.server.serving.server import Server
from fuelline.server.serving.slabs import SessionSlabs
from fuelline.server.sources.parquet import ParquetSource

from support.processes import wait_until

TIMEOUT = 20.0
HWM = 4


@pytest.fixture
def server(sample_dataset: Path):
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")
    source = ParquetSource(str(sample_dataset), batch_size=100, seed=3)
    server = Server(source, port=0, hwm=HWM, heartbeat=5.0)
    server.start()
    yield server
    server.stop()
    server.join(10)
    source.close()


def stream(server: Server, **options) -> ServerDataStream:
    return ServerDataStream(("sample_id", "features"), endpoints=[server.endpoint.removeprefix("tcp://")], hwm=HWM, timeout=TIMEOUT,
                            receive_timeout=TIMEOUT, **options)


def placed(array: np.ndarray) -> bool:
    """Whether an array lies on a mapping of a server's slab (its base is a slab lease)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, ctypes.Array)


def epoch(server: Server, keep: bool = False, **options) -> list[dict[str, np.ndarray]]:
    """One epoch's batches, as copies (``keep``: as served, every batch still held), with
    ``placed``: whether the batch came in shared memory."""
    with stream(server, **options) as s:
        return [{"sample_id": b[0] if keep else b[0].copy(), "features": b[1] if keep else b[1].copy(),
                 "placed": np.array([placed(b[0]) and placed(b[1])])}
                for b in s.get_epoch_iterator()]


def shared(batches: list[dict[str, np.ndarray]]) -> int:
    return sum(bool(b["placed"][0]) for b in batches)


def slab_files(server: Server) -> list[str]:
    assert server.slab_folder is not None
    return glob.glob(os.path.join(server.slab_folder, "slab-*"))


def assert_same(got: list[dict[str, np.ndarray]], expected: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for name in ("sample_id", "features"):
            np.testing.assert_array_equal(a[name], b[name])


def test_a_local_client_reads_the_same_epoch_from_shared_memory(server: Server) -> None:
    wire = epoch(server, shared_memory=False)
    tcp = epoch(server, local=False)
    assert server.stats["batches_shared"] == shared(wire) == shared(tcp) == 0
    replayed = server.recent.hits
    with stream(server) as s:
        local = [{"sample_id": b[0].copy(), "features": b[1].copy(), "placed": np.array([placed(b[0]) and placed(b[1])])}
                 for b in s.get_epoch_iterator()]
        (session,) = server.sessions.values()
        # Shuffled rows gathered straight into shared memory: nothing copied them again. (The
        # batches sent over TCP before the move come again from the memory tier, and are copied.)
        replayed = server.recent.hits - replayed
        assert session.slabs is not None and session.slabs.built_in_place >= 80 - replayed > 80 - 2 * HWM - 2
    assert shared(local) == len(local) == 80
    assert server.stats["batches_shared"] >= 80  # (and those it sent ahead, of the next epoch)
    assert_same(local, wire)
    assert_same(local, tcp)


class Large:
    """A Fuel-style stream of 120 batches of 256 KB: four to a slab of 1 MB."""

    sources = ("x",)

    def get_epoch_iterator(self, **kwargs):
        for i in range(120):
            yield (np.full((64, 1024), i, dtype=np.float32),)


@pytest.fixture
def large_server():
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")
    from fuelline.server.sources.fuel import FuelStreamSource

    with Server(FuelStreamSource(Large(), fresh_arrays=True), port=0, hwm=HWM, heartbeat=5.0) as server:
        yield server


def large_stream(server: Server) -> ServerDataStream:
    return ServerDataStream(endpoints=[server.endpoint.removeprefix("tcp://")], hwm=HWM, timeout=TIMEOUT,
                            receive_timeout=TIMEOUT)


def test_a_batch_the_user_holds_is_never_written_again(large_server: Server) -> None:
    with large_stream(large_server) as s:
        it = s.get_epoch_iterator()
        held = next(it)[0]
        view = held[3:7]  # a slice keeps the batch's memory too
        del held
        taken = 0
        for _ in range(3):
            for (x,) in it:
                taken += placed(x)
                assert (x == x[0, 0]).all()
                # Every slab the session made is one it may make: prepared, in flight, held.
                assert len(slab_files(large_server)) <= 3 * HWM + 8
            it = s.get_epoch_iterator()
        assert taken > 4 * (3 * HWM + 8)  # more batches in shared memory than its slabs hold at once
        assert (view == 0).all()


def test_slabs_are_reused_once_released(large_server: Server) -> None:
    taken = 0
    with large_stream(large_server) as s:
        for _ in range(3):
            for (x,) in s.get_epoch_iterator():
                taken += placed(x)
        (session,) = large_server.sessions.values()
        assert session.slabs is not None
        made = session.slabs._names
    # 360 batches, four to a slab, from at most 20 slabs: each slab went back and was used again.
    assert taken == 360
    assert made <= 3 * HWM + 8


def test_a_client_that_keeps_every_batch_gets_the_rest_through_the_socket(large_server: Server) -> None:
    with large_stream(large_server) as s:
        kept = [b[0] for b in s.get_epoch_iterator()]
        assert len(slab_files(large_server)) <= 3 * HWM + 8
    assert [int(a[0, 0]) for a in kept] == list(range(120))
    assert all((a == a[0, 0]).all() for a in kept)  # none was written over while held
    # The session stopped at its cap of slabs, four batches each; the rest went over the socket.
    in_shared = sum(placed(a) for a in kept)
    assert 0 < in_shared <= 4 * (3 * HWM + 8) < len(kept)


def test_a_session_removes_its_slabs_when_it_ends(server: Server) -> None:
    with stream(server) as s:
        it = s.get_epoch_iterator()
        held = next(it)
        assert slab_files(server)
    wait_until(lambda: not server.sessions, TIMEOUT, "the session ended after the client's bye")
    assert slab_files(server) == []
    # The batch the user kept is still readable: its mapping outlives the file.
    assert held[0].shape == (100,) and int(held[0].max()) < 10_000
    folder = server.slab_folder
    server.stop()
    server.join(10)
    assert not os.path.exists(folder)


def test_a_server_whose_socket_folder_is_on_disk_sends_through_the_socket(
    sample_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if on_memory_fs(str(tmp_path)):
        pytest.skip(f"{tmp_path} is in memory")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    source = ParquetSource(str(sample_dataset), batch_size=100, seed=3)
    with Server(source, port=0, hwm=HWM, heartbeat=5.0) as server:
        assert server.slab_folder is None and server.local is not None
        assert shared(epoch(server)) == server.stats["batches_shared"] == 0
    source.close()


def test_a_server_may_keep_shared_memory_off(sample_dataset: Path) -> None:
    source = ParquetSource(str(sample_dataset), batch_size=100, seed=3)
    with Server(source, port=0, hwm=HWM, heartbeat=5.0, shared_memory=False) as server:
        assert server.slab_folder is None
        assert shared(epoch(server)) == server.stats["batches_shared"] == 0
    source.close()


def test_a_slab_that_cannot_be_mapped_sends_the_client_back_to_the_socket(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = epoch(server, shared_memory=False)
    # As if the server's folder were out of this client's reach (another mount namespace).
    monkeypatch.setattr(connection, "ClientSlabs", lambda folder: ClientSlabs(str(tmp_path / "elsewhere")))
    with caplog.at_level(logging.WARNING, logger="fuelline.client"):
        got = epoch(server)
    assert_same(got, expected)
    assert shared(got) == 0
    assert any("reading through the socket instead" in r.getMessage() and "elsewhere" in r.getMessage()
               for r in caplog.records)


# -- lies and limits --------------------------------------------------------------------------------


def placed_header(slab: str, at: list[int], shape: tuple[int, ...] = (4,)) -> bytes:
    meta = ArrayMeta("x", "<f4", shape, 4 * int(np.prod(shape)), None)
    return msgpack.packb({"v": VERSION, "t": "batch", "stream": 1, "epoch": 0, "seq": 0, "a": [meta.to_wire()],
                          "ck": None, "m": {"slab": slab, "r": 7, "at": at}})


def test_a_placed_batch_is_refused_by_a_connection_that_did_not_ask_for_one() -> None:
    with pytest.raises(ProtocolError, match="did not ask for"):
        decode([placed_header("slab-ab-0", [0])])


@pytest.mark.parametrize("slab, at, why", [
    ("../../etc/passwd", [0], "not a slab's file name"),
    ("/dev/shm/slab-ab-0", [0], "not a slab's file name"),
    ("slab-ab-0", [-64], "negative, unaligned"),
    ("slab-ab-0", [3], "negative, unaligned"),
    ("slab-ab-0", [0, 8], "offsets for 1 arrays"),
    ("slab-ab-0", [0, 64], "offsets for 1 arrays"),
])
def test_a_placement_that_points_elsewhere_is_refused(slab: str, at: list[int], why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode([placed_header(slab, at)], place=lambda stream, metas, placement: {})


def test_a_placement_past_the_end_of_its_slab_is_refused(tmp_path: Path) -> None:
    (tmp_path / "slab-ab-0").write_bytes(bytes(1024))
    slabs = ClientSlabs(str(tmp_path))
    meta = ArrayMeta("x", "<f4", (256,), 1024, None)
    assert slabs.arrays([meta], Placement("slab-ab-0", 1, (0,)))["x"].shape == (256,)
    with pytest.raises(ProtocolError, match="slab-ab-0 reaches byte 1088, past its end at 1024"):
        slabs.arrays([meta], Placement("slab-ab-0", 2, (64,)))


def test_a_session_frees_only_the_regions_it_lent(tmp_path: Path) -> None:
    mine, other = SessionSlabs(str(tmp_path), "aa", 4, keep_free=0), SessionSlabs(str(tmp_path), "bb", 4, keep_free=0)
    placed = mine.place({"x": np.arange(10)}).placement
    theirs = other.place({"x": np.arange(10)}).placement
    mine.release((theirs.region, 10**12))  # another session's region, and one never lent
    assert mine.lent == 1 and other.lent == 1
    mine.release((placed.region,))
    assert mine.lent == 0
    mine.close()
    other.close()
    assert list(tmp_path.iterdir()) == []


def test_slab_files_are_this_users_alone(server: Server) -> None:
    with stream(server) as s:
        next(s.get_epoch_iterator())
        modes = {oct(os.stat(p).st_mode & 0o777) for p in slab_files(server)}
    assert modes == {"0o600"}
    assert oct(os.stat(server.slab_folder).st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("credit, why", [
    ({"n": 0}, "Credit.n must be an int >= 1"),
    ({"n": 0, "released": [-1]}, "not a region id"),
    ({"n": 1, "released": list(range(4097))}, "at most 4096"),
])
def test_a_credit_that_releases_nonsense_is_malformed(credit: dict, why: str) -> None:
    frame = msgpack.packb({"v": VERSION, "t": "credit", **credit})
    with pytest.raises(ProtocolError, match=why):
        decode([frame])


def test_a_credit_that_only_releases_round_trips() -> None:
    assert decode(encode(Credit(0, (1, 2, 3)))) == Credit(0, (1, 2, 3))


def test_a_client_maps_only_the_slabs_of_its_current_session(tmp_path: Path) -> None:
    for name in ("slab-aa-0", "slab-aa-1", "slab-bb-0"):
        (tmp_path / name).write_bytes(np.full(256, ord(name[-4]), dtype=np.uint8).tobytes())
    slabs = ClientSlabs(str(tmp_path))
    meta = ArrayMeta("x", "|u1", (256,), 256, None)
    old = slabs.arrays([meta], Placement("slab-aa-0", 1, (0,)))["x"]
    slabs.arrays([meta], Placement("slab-aa-1", 2, (0,)))
    assert len(slabs._maps) == 2
    slabs.arrays([meta], Placement("slab-bb-0", 3, (0,)))
    # The session before is over: its slabs are let go, but a batch still held keeps its own.
    assert list(slabs._maps) == ["slab-bb-0"]
    assert (old == ord("a")).all()


def test_a_server_that_cannot_make_a_slab_says_so_and_sends_through_the_socket(
    sample_dataset: Path, start_serve, tmp_path: Path
) -> None:
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")
    import sys

    from support.processes import ServerProcess

    expected = start_serve(sample_dataset, "--batch-size", "100", "--seed", "3")
    with ServerDataStream(("sample_id",), endpoints=[expected.endpoint], timeout=TIMEOUT, local=False) as s:
        want = [b[0].tolist() for b in s.get_epoch_iterator()]
    # No file may grow past 512 KB in this server, so its first slab (1 MB, reserved at once) fails
    # as on a full /dev/shm (EFBIG here, ENOSPC there: the same path).
    serve = f"ulimit -f 512; exec {sys.executable} -m fuelline.server.cli serve {sample_dataset} --port 0 " \
            "--batch-size 100 --seed 3"
    server = ServerProcess(["bash", "-c", serve], tmp_path / "limited.log")
    try:
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as s:
            got = [(b[0].tolist(), placed(b[0])) for b in s.get_epoch_iterator()]
            assert s.transports[0].startswith("ipc://")
        assert [ids for ids, _ in got] == want
        assert not any(p for _, p in got)
        assert "cannot make a shared-memory slab" in server.log() and "go through the socket" in server.log()
    finally:
        assert server.terminate() == 0


def test_the_slabs_of_a_killed_server_go_at_the_next_start(sample_dataset: Path, start_serve) -> None:
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")
    server = start_serve(sample_dataset, "--batch-size", "100")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT, heartbeat=0.2) as s:
        it = s.get_epoch_iterator()
        held = next(it)[0]
        assert placed(held)
        folder = os.path.dirname(s.transports[0][len("ipc://"):])
        assert glob.glob(os.path.join(folder, "slab-*"))
        copy = held.copy()
        server.kill()
        start_serve(sample_dataset, "--batch-size", "100")  # (its start sweeps what the dead one left)
        assert not os.path.exists(folder)
        np.testing.assert_array_equal(held, copy)  # the batch held outlives its file and its server


def test_no_slab_is_made_that_would_leave_its_file_system_short(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    usage = shutil.disk_usage(tmp_path)
    # As if the folder's file system (a small /dev/shm) were nearly full: keep all but 512 KB free.
    slabs = SessionSlabs(str(tmp_path), "aa", 4, keep_free=(usage.free - 2**19) / usage.total)
    with caplog.at_level(logging.WARNING, logger="fuelline.server"):
        assert slabs.place({"x": np.arange(10)}) is None
    assert slabs.passed == 1 and list(tmp_path.iterdir()) == []
    assert "cannot make a shared-memory slab of 1 MB" in caplog.text and "under" in caplog.text
    roomy = SessionSlabs(str(tmp_path), "bb", 4, keep_free=0.0)
    assert roomy.place({"x": np.arange(10)}) is not None
    roomy.close()


def test_one_array_served_under_two_names_is_placed_as_two(tmp_path: Path) -> None:
    slabs = SessionSlabs(str(tmp_path), "aa", 4, keep_free=0)
    (x,) = slabs.carve([((8, 4), np.dtype("<f4"))])
    x[...] = np.arange(32, dtype=np.float32).reshape(8, 4)
    metas, placement, in_place = slabs.place({"a": x, "b": x[:4]})  # overlapping memory in the slab
    Placement.from_wire(placement.to_wire(), metas)  # what a client checks: no overlap
    assert not in_place and slabs.built_in_place == 0 and slabs.placed == 1
    assert slabs.place({"a": x[:4], "b": x[4:]}).in_place  # disjoint: placed where they lie
    assert slabs.built_in_place == 1
    slabs.close()


def test_the_memory_tier_keeps_no_batch_built_in_a_slab(server: Server) -> None:
    # A slab is written again once its client lets a batch go: a batch built there, kept for a
    # reconnect, would be served changed.
    with stream(server, client_id="kept") as s:
        for _ in range(2):
            for _ in s.get_epoch_iterator():
                pass
        (session,) = server.sessions.values()
        assert session.slabs is not None and session.slabs.built_in_place > 100
        kept = [entry[0] for c in server.recent._clients.values() for entry in c.batches.values()]
        assert not any(session.slabs.holds(arrays) for arrays in kept)
    # (And the tier does keep batches: those of a client reading through TCP.)
    with stream(server, client_id="remote", local=False) as s:
        next(iter(s.get_epoch_iterator()))
        wait_until(lambda: "remote" in server.recent._clients, TIMEOUT, "batches kept for the TCP client")
        assert server.recent._clients["remote"].batches


def test_a_remote_peer_that_asks_for_shared_memory_gets_its_batches_on_the_wire(
    server: Server, zmq_context
) -> None:
    from fuelline.protocol import Batch, Hello

    from support.raw_client import RawClient

    # Over TCP the server cannot tell a peer on its host from one elsewhere: a Hello that asks
    # for shared memory is a lie it does not believe.
    client = RawClient(zmq_context, server.endpoint.removeprefix("tcp://"))
    client.send(Hello("liar", credit=2, heartbeat=5.0, shm=True))
    assert client.recv().TYPE == "welcome"
    batch = client.recv()  # (RawClient decodes without a place: a placed batch would be refused)
    assert isinstance(batch, Batch) and batch.checksum == "xxh3_64" and len(batch.arrays["sample_id"]) == 100
    assert server.stats["batches_shared"] == 0


def test_a_server_restarted_without_shared_memory_goes_on_through_the_socket(
    sample_dataset: Path, start_serve
) -> None:
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")
    args = ("--batch-size", "100", "--seed", "3")
    first = start_serve(sample_dataset, *args)
    with ServerDataStream(("sample_id",), endpoints=[first.endpoint], timeout=TIMEOUT, local=False) as s:
        want = [b[0].tolist() for b in s.get_epoch_iterator()]
    with ServerDataStream(("sample_id",), endpoints=[first.endpoint], timeout=TIMEOUT, heartbeat=0.2, hwm=2) as s:
        it = s.get_epoch_iterator()
        got = [next(it)[0] for _ in range(30)]
        assert all(placed(a) for a in got)
        held = [a.copy() for a in got]
        first.kill()  # mid-epoch; the next server keeps every batch on the socket
        start_serve(sample_dataset, *args, "--no-shared-memory", "--port", first.endpoint.rpartition(":")[2])
        rest = list(it)
    assert [a.tolist() for a in got] == [a.tolist() for a in held]  # what was held, unchanged
    assert [a.tolist() for a in got] + [a[0].tolist() for a in rest] == want
    # At most hwm (2) of them had arrived from the first server before it died, in shared memory
    # still readable; every one after came through the socket.
    from_first = [placed(a[0]) for a in rest]
    assert not any(from_first[2:]) and sum(from_first) <= 2


def test_the_slabs_of_a_client_killed_mid_stream_are_removed(server: Server, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    script = tmp_path / "reader.py"
    script.write_text(
        "import sys\n"
        "from fuelline.client import ServerDataStream\n"
        f"s = ServerDataStream(('sample_id',), endpoints=[{server.endpoint.removeprefix('tcp://')!r}], heartbeat=0.2)\n"
        "held = []\n"
        "for b in s.get_epoch_iterator():\n"
        "    held.append(b)\n"
        "    if len(held) == 5:\n"
        "        print('holding', flush=True)\n"
        "        sys.stdin.read()\n"
    )
    reader = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "holding"
        wait_until(lambda: slab_files(server) != [], TIMEOUT, "the reader's session made slabs")
        reader.send_signal(signal.SIGKILL)
        reader.wait(TIMEOUT)
        wait_until(lambda: not server.sessions, TIMEOUT, "the server dropped the silent reader")
        assert slab_files(server) == []
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(TIMEOUT)


def test_a_slab_is_not_used_again_while_an_array_built_in_it_is_held(tmp_path: Path) -> None:
    # A Fuel stream's shared pass keeps the batches it copied into a slab, for other ranks and for
    # reconnects, after the client released them.
    slabs = SessionSlabs(str(tmp_path), "aa", 8, keep_free=0)
    spec = [((256, 1024), np.dtype("<f4"))]  # 1 MB: a slab each
    (held,) = slabs.carve(spec)
    held[...] = 7.0
    first = slabs.place({"x": held})
    assert first is not None and first.in_place
    slabs.release((first.placement.region,))  # the client let it go; the pass still holds it
    (other,) = slabs.carve(spec)  # the next gather needs room: a new slab, not the held one
    assert not np.shares_memory(other, held) and np.all(held == 7.0)
    assert slabs.place({"x": other}).in_place
    where = held.__array_interface__["data"][0]
    del held
    (again,) = slabs.carve(spec)  # now nothing holds the first slab: it is used again
    assert again.__array_interface__["data"][0] == where
    slabs.close()


REFILLED = 60


class Refilled:
    """A Fuel stream that refills one buffer for every batch, each with its own value."""

    sources = ("x",)

    def __init__(self) -> None:
        self.buffer = np.empty((128, 1024), np.float32)

    def get_epoch_iterator(self, **kwargs):
        for i in range(REFILLED):
            self.buffer[:] = i
            yield (self.buffer,)


@pytest.mark.parametrize("world", [1, 2])
def test_a_local_client_of_a_fuel_stream_gets_the_servers_one_copy_in_shared_memory(world: int) -> None:
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")
    from fuelline.server.sources.fuel import FuelStreamSource

    source = FuelStreamSource(Refilled())
    server = Server(source, port=0, hwm=HWM, heartbeat=5.0)
    server.start()
    try:
        got = {}
        for rank in range(world):  # (rank 1 reads what rank 0's session copied for it)
            with ServerDataStream(("x",), endpoints=[server.endpoint.removeprefix("tcp://")], hwm=HWM,
                                  timeout=TIMEOUT, receive_timeout=TIMEOUT, rank=rank, world_size=world) as s:
                got[rank] = [(float(b[0][0, 0]), bool(np.all(b[0] == b[0][0, 0])), placed(b[0]))
                             for b in s.get_epoch_iterator()]
                (session,) = server.sessions.values()
                assert session.slabs is not None
                built, placed_all = session.slabs.built_in_place, session.slabs.placed
            assert all(same and shm for _, same, shm in got[rank]), f"rank {rank}: {got[rank]}"
            assert [v for v, _, _ in got[rank]] == [float(i) for i in range(rank, REFILLED, world)]
            if rank == 0:  # copied once, into the memory the client maps: nothing copied it again
                assert built == placed_all >= len(got[0])  # (and those it prepared of the next epoch)
    finally:
        server.stop()
        server.join(10)
        source.close()
