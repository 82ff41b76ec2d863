"""Fixtures: datasets, real server processes on ephemeral ports (with a readiness handshake and
deadlines, stopped with SIGTERM at teardown), ZeroMQ contexts whose sockets are closed, worker
pools, and a watcher that fails the run if any process a test started outlives the session. The
helpers behind them are in tests/support/."""

from __future__ import annotations

import logging
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from fuelline.protocol.common.logs import StderrHandler
from fuelline.server.ingest.convert import convert
from fuelline.server.ingest.synth import synthesize
from fuelline.server.sources.sample import write_sample_dataset
from fuelline.server.workers.pool import WorkerPool

from support import strays
from support.processes import ServerProcess


def pytest_configure(config: pytest.Config) -> None:
    # Every process a test starts is found and, if still running when the session ends, killed
    # and reported as a failure (tests/support/strays.py).
    if not config.pluginmanager.is_registered(strays):
        config.pluginmanager.register(strays, "fuelline-strays")


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    """A test that runs a command in this process (``main([...])``) configures logging as the
    command does; its handler, which writes to whatever stderr is at the moment, would otherwise
    stay, and print the records of later tests' server threads to the terminal between tests."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if isinstance(handler, StderrHandler) and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 000 rows (8 000 train, 2 000 val) in 4 files per split, row groups of 500 rows."""
    out = tmp_path_factory.mktemp("data") / "sample"
    write_sample_dataset(str(out), rows=10_000, dim=8, files=4, row_group_rows=500)
    return out


@pytest.fixture(scope="session")
def converted_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small converted multimodal dataset: 6 synthetic recordings of 12 s, train and val."""
    root = tmp_path_factory.mktemp("converted")
    synthesize(str(root / "raw"), 6, 12.0, 11, video_dim=4)
    convert(str(root / "raw"), str(root / "data"), val_fraction=0.34, progress=False)
    return root / "data"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted multimodal dataset for the remote-storage tests: 12 recordings of 10 s with
    dropped and jittered samples, 30 % of them in val."""
    root = tmp_path_factory.mktemp("remote-windows")
    synthesize(str(root / "raw"), 12, 10.0, 5, video_dim=4, drop=0.01, jitter_ms=0.3)
    convert(str(root / "raw"), str(root / "data"), val_fraction=0.3, seed=0, progress=False)
    return root / "data"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    """Every server process a test starts; all are stopped at teardown."""
    started: list[ServerProcess] = []
    yield started
    ignored = [server for server in started if not server.close()]
    assert not ignored, "servers that ignored SIGTERM and were killed: " + "; ".join(
        f"{' '.join(map(str, s.args[1:6]))} ({s.log_path}): {s.log_path.read_text()[-2000:]}" for s in ignored)


@pytest.fixture
def start_serve(tmp_path: Path, servers: list[ServerProcess]):
    """Start ``fuelline serve DATASET --port 0 …`` processes."""

    def start(dataset: Path | str, *options: str) -> ServerProcess:
        args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0", *options]
        servers.append(ServerProcess(args, tmp_path / f"server-{len(servers)}.log"))
        return servers[-1]

    return start


@pytest.fixture
def start_script(tmp_path: Path, servers: list[ServerProcess]):
    """Run a Python snippet (that calls start_server with port=0) as a server process."""

    def start(code: str) -> ServerProcess:
        script = tmp_path / f"server-{len(servers)}.py"
        script.write_text(textwrap.dedent(code))
        servers.append(ServerProcess([sys.executable, str(script)], tmp_path / f"server-{len(servers)}.log"))
        return servers[-1]

    return start


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    """A context of the test's own (never the process-wide instance): at teardown every socket the
    test left open is closed without lingering, and the context must terminate within 5 s."""
    ctx = zmq.Context()
    yield ctx
    for sock in list(ctx._sockets):  # (pyzmq's record of the context's live sockets)
        if not sock.closed:
            sock.close(linger=0)
    done = threading.Thread(target=ctx.term, name="zmq-term", daemon=True)
    done.start()
    done.join(5.0)
    assert not done.is_alive(), "the test's ZeroMQ context did not terminate within 5 s"


@pytest.fixture
def pools():
    """Worker pools a test starts; all are closed at teardown."""
    started: list[WorkerPool] = []
    yield started
    for pool in started:
        pool.close()
