"""Device prefetch (``device=``, ``pin_memory=``): batches handed over as torch tensors where the
caller computes, equal to the numpy batches; a batch taken ahead is not counted in the position
(state_dict, pickling, resume); what this host cannot do is refused at construction, naming the
argument. The CUDA path itself runs on a GPU host only."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from fuelline.client import ServerDataset, ServerDataStream  # noqa: E402
from fuelline.client.device import BUFFERS_PER_KEY  # noqa: E402

from support.processes import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
SOURCES = ("sample_id", "features", "label")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
pytestmark = pytest.mark.timeout(120)


def numpy_epochs(endpoint: str, epochs: int) -> list[list[tuple[np.ndarray, ...]]]:
    with ServerDataStream(SOURCES, endpoints=[endpoint], timeout=TIMEOUT) as stream:
        return [[tuple(a.copy() for a in b) for b in stream.get_epoch_iterator()] for _ in range(epochs)]


def ids(batch) -> tuple[int, ...]:
    return tuple(batch[0].tolist())


def queued(stream: ServerDataStream) -> int:
    """Batches the stream's connection holds received and not yet taken: waiting for two before a
    batch is taken makes sure the one after it is there to be taken ahead."""
    return len(stream._conns[0]._items)


def test_device_cpu_gives_tensors_equal_to_the_numpy_batches(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = numpy_epochs(server.endpoint, 2)
    with ServerDataStream(SOURCES, endpoints=[server.endpoint], device="cpu", timeout=TIMEOUT) as stream:
        assert stream.device == torch.device("cpu") and stream.pin_memory is False
        for epoch in expected:  # two whole epochs: the end of the first is taken ahead too
            got = list(stream.get_epoch_iterator())
            assert len(got) == len(epoch)
            for batch, want in zip(got, epoch):
                assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in batch)
                for t, a in zip(batch, want):
                    assert torch.equal(t, torch.from_numpy(a))
        assert stream.placement is not None and stream.placement.staged == sum(map(len, expected))
        as_dict = next(iter(stream.get_epoch_iterator(as_dict=True)))
    assert list(as_dict) == list(SOURCES) and isinstance(as_dict["features"], torch.Tensor)


def test_a_batch_taken_ahead_is_not_counted_in_the_position(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = [ids(b) for b in numpy_epochs(server.endpoint, 1)[0]]
    with ServerDataStream(SOURCES, endpoints=[server.endpoint], device="cpu", hwm=4, timeout=TIMEOUT) as stream, \
            ServerDataStream(SOURCES, endpoints=[server.endpoint], hwm=4, timeout=TIMEOUT) as plain:
        it, plain_it = stream.get_epoch_iterator(), plain.get_epoch_iterator()
        taken = []
        for n in range(1, 6):
            wait_until(lambda: queued(stream) >= 2, TIMEOUT, "two batches received")
            taken.append(ids(next(it)))
            next(plain_it)
            assert stream.placement is not None and stream.placement.staged_ahead == n  # one is held ahead
            state = stream.state_dict()
            assert state["cursor"] == n
            assert state == plain.state_dict()  # the same position as a stream without a device
        # Resumed where it is, the stream starts with the batch it held ahead: nothing lost.
        stream.load_state_dict(state)
        rest = [ids(b) for b in stream.get_epoch_iterator()]
    assert taken == expected[:5]
    assert taken + rest == expected


def test_two_servers_in_turn_give_the_same_batches_and_positions_with_a_device(sample_dataset: Path,
                                                                                 start_serve) -> None:
    endpoints = [start_serve(sample_dataset, "--batch-size", "100").endpoint for _ in range(2)]

    def read(**options) -> tuple[list[list[tuple[int, ...]]], list[dict]]:
        with ServerDataStream(SOURCES, endpoints=endpoints, hwm=4, timeout=TIMEOUT, **options) as stream:
            epochs, states = [], []
            for _ in range(2):  # the end of the first epoch is taken ahead, from both servers
                epoch = []
                for batch in stream.get_epoch_iterator():
                    epoch.append(ids(batch))
                    if len(epoch) == 7:
                        states.append(stream.state_dict())
                epochs.append(epoch)
                states.append(stream.state_dict())
            if options:
                assert stream.placement is not None and stream.placement.staged_ahead > 0
            return epochs, states

    assert read(device="cpu") == read()


def test_a_pickled_stream_keeps_its_device_and_its_position(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = [ids(b) for b in numpy_epochs(server.endpoint, 1)[0]]
    with ServerDataStream(SOURCES, endpoints=[server.endpoint], device=torch.device("cpu"), hwm=4,
                          timeout=TIMEOUT) as stream:
        it = stream.get_epoch_iterator()
        wait_until(lambda: queued(stream) >= 2, TIMEOUT, "two batches received")
        before = [ids(next(it))]
        assert stream.placement is not None and stream.placement.staged_ahead == 1
        copy = pickle.loads(pickle.dumps(stream))
    try:
        assert copy.device == torch.device("cpu") and copy.pin_memory is False
        assert copy.state_dict()["cursor"] == 1
        after = list(copy.get_epoch_iterator())
        assert all(isinstance(t, torch.Tensor) for b in after for t in b)
        assert before + [ids(b) for b in after] == expected
    finally:
        copy.close()


@pytest.mark.skipif(CUDA, reason="this host has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "torch.device('cuda', 1)", "0"])
def test_a_cuda_device_is_refused_where_there_is_no_cuda(device: str) -> None:
    value = eval(device) if device.startswith("torch") or device.isdigit() else device  # (a fixed list: no input)
    with pytest.raises(ValueError, match=r"device=.*: CUDA is not available on this host.*pass device='cpu'"):
        ServerDataStream(SOURCES, endpoints=["127.0.0.1:9"], device=value)
    with pytest.raises(ValueError, match=r"device=.*CUDA is not available"):
        ServerDataset(SOURCES, endpoints=["127.0.0.1:9"], device=value)


@pytest.mark.parametrize("device, says", [
    ("bogus", r"device='bogus' is not a torch device"),
    ("cuda:x", r"device='cuda:x' is not a torch device"),
    (2.5, r"device must be a device string, a torch.device or a CUDA index, got 2.5"),
    ("meta", r"device='meta': only 'cpu' and CUDA devices are supported"),
    (-1, r"device=-1 is not a torch device"),
])
def test_a_device_that_is_not_one_is_refused_naming_the_argument(device: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ServerDataStream(SOURCES, endpoints=["127.0.0.1:9"], device=device)


@pytest.mark.skipif(CUDA, reason="this host can pin memory")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_pin_memory_is_refused_where_torch_cannot_pin(device: str | None) -> None:
    with pytest.raises(ValueError, match=r"pin_memory=True: torch cannot pin host memory on this host .*"
                                         r"pass pin_memory=False"):
        ServerDataStream(SOURCES, endpoints=["127.0.0.1:9"], device=device, pin_memory=True)


def test_a_dataset_places_its_batches_without_workers(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = numpy_epochs(server.endpoint, 1)[0]
    dataset = ServerDataset(SOURCES, endpoints=[server.endpoint], device="cpu", timeout=TIMEOUT)
    got = list(DataLoader(dataset, batch_size=None, num_workers=0))
    assert [ids(b) for b in got] == [ids(b) for b in expected]
    assert all(isinstance(t, torch.Tensor) for b in got for t in b)
    assert torch.equal(got[3][1], torch.from_numpy(expected[3][1]))
    assert dataset.state_dict()["batches"] == len(expected)


def test_a_dataset_with_a_device_refuses_dataloader_workers(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    dataset = ServerDataset(SOURCES, endpoints=[server.endpoint], device="cpu", timeout=TIMEOUT)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, timeout=TIMEOUT)
    with pytest.raises(ValueError, match=r"DataLoader worker 0 of num_workers=1: use num_workers=0, or leave "
                                         r"device and pin_memory unset, pass pin_memory=True to the DataLoader"):
        next(iter(loader))


@pytest.mark.skipif(CUDA, reason="this host has CUDA")
def test_the_benchmark_refuses_a_host_without_cuda() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.device_prefetch", "--rounds", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "device_prefetch needs a CUDA GPU: torch.cuda.is_available() is False on this host" in done.stderr
    assert "run it on a GPU host" in done.stderr


# -- on a GPU host -----------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("pin_memory", [False, True])
def test_cuda_batches_are_on_the_device_and_equal_the_cpu_ones(sample_dataset: Path, start_serve,
                                                               pin_memory: bool) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = numpy_epochs(server.endpoint, 2)
    with ServerDataStream(SOURCES, endpoints=[server.endpoint], device="cuda", pin_memory=pin_memory,
                          timeout=TIMEOUT) as stream:
        for epoch in expected:
            n = 0
            for batch, want in zip(stream.get_epoch_iterator(), epoch, strict=True):
                n += 1
                assert all(t.device.type == "cuda" for t in batch)
                for t, a in zip(batch, want):
                    assert torch.equal(t.cpu(), torch.from_numpy(a))
            assert n == len(epoch)
        placement = stream.placement
        assert placement is not None and placement.device.index == torch.cuda.current_device()
        assert placement.staged_ahead > 0  # batches were copied while the one before was in use
        if pin_memory:
            # Reused, not pinned afresh each batch: at most a few buffers per source.
            assert 0 < placement.pinned <= BUFFERS_PER_KEY * len(SOURCES)


@needs_cuda
def test_pinned_cpu_tensors_where_torch_can_pin(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = numpy_epochs(server.endpoint, 1)[0]
    with ServerDataStream(SOURCES, endpoints=[server.endpoint], device="cpu", pin_memory=True,
                          timeout=TIMEOUT) as stream:
        got = list(stream.get_epoch_iterator())
    assert all(t.device.type == "cpu" and t.is_pinned() for b in got for t in b)
    assert [ids(b) for b in got] == [ids(b) for b in expected]


@needs_cuda
def test_a_training_step_uses_cuda_batches_at_once(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    expected = numpy_epochs(server.endpoint, 1)[0]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 6).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    side = torch.cuda.Stream()  # the caller's own current stream: the hand-over must wait on it too
    side.wait_stream(torch.cuda.current_stream())  # (the model's parameters were made on the default one)
    with ServerDataStream(SOURCES, endpoints=[server.endpoint], device="cuda", pin_memory=True,
                          timeout=TIMEOUT) as stream, torch.cuda.stream(side):
        sums, losses = [], []
        for _, features, label in stream.get_epoch_iterator():
            # No synchronisation here: the kernels are queued on the current stream at once.
            sums.append(features.sum(dim=1))
            loss = torch.nn.functional.cross_entropy(model(features), label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    torch.cuda.synchronize()
    for got, want in zip(sums, expected, strict=True):
        assert torch.allclose(got.cpu(), torch.from_numpy(want[1]).sum(dim=1))
    assert all(torch.isfinite(x).item() for x in losses)
