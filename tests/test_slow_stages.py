"""A user's stage that takes seconds, or never returns, does not stall the server: it runs off the
serving loop, so heartbeats and other clients' batches go out meanwhile, it is reported, and SIGTERM
still ends the server in bounded time, naming the stage it abandoned.

Real ``fuelline serve`` processes with stages written by the test, real clients. The stages wait on
files the test creates (a gate), so nothing here depends on how long anything takes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import ServerUnavailable
from fuelline.server.serving.start import STOP_DEADLINE

from support.processes import ServerProcess, wait_until

STAGES = '''
import os, time

GATE = os.environ["TEST_STAGE_GATE"]
SLEEP = float(os.environ.get("TEST_STAGE_SECONDS", "0"))


def sleeps(batch):
    """Every batch takes TEST_STAGE_SECONDS."""
    time.sleep(SLEEP)
    return batch


def val_waits(batch):
    """A batch with a window of a val recording waits until the gate file exists."""
    if set((batch["sample_id"] // 1_000_000).tolist()) & VAL:
        open(GATE + ".entered", "w").close()
        while not os.path.exists(GATE):
            time.sleep(0.01)
    return batch


def hangs(batch):
    """Never returns on a served batch (the server's start-up probe of two windows goes through)."""
    if len(batch["sample_id"]) > 2:
        open(GATE + ".entered", "w").close()
    while len(batch["sample_id"]) > 2:
        time.sleep(0.05)
    return batch


VAL = set(int(r) for r in os.environ.get("TEST_VAL_RECORDINGS", "").split(",") if r)
'''


@pytest.fixture
def stages(tmp_path: Path) -> Path:
    folder = tmp_path / "stages"
    folder.mkdir()
    (folder / "usr_stages.py").write_text(textwrap.dedent(STAGES))
    return folder


def val_recordings(dataset: Path) -> str:
    from fuelline.server.multimodal.manifest import Manifest
    from fuelline.server.sources.storage import Store

    manifest = Manifest.load(Store(str(dataset)))
    return ",".join(str(i) for i, r in enumerate(manifest.recordings) if r.split == "val")


def serve(servers: list, tmp_path: Path, stages: Path, dataset: Path, stage: str, *options: str, **env: str) -> ServerProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stages), os.environ.get("PYTHONPATH", "")]),
               "TEST_STAGE_GATE": str(tmp_path / "gate"), "TEST_VAL_RECORDINGS": val_recordings(dataset), **env}
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0", "--batch-size", "8",
            "--stage", f"usr_stages:{stage}", *options]
    servers.append(ServerProcess(args, tmp_path / f"server-{len(servers)}.log", env=environ))
    return servers[-1]


def test_a_stage_of_seconds_a_batch_keeps_its_client_connected_and_is_reported(
        converted: Path, servers: list, tmp_path: Path, stages: Path) -> None:
    # Each batch takes 5 heartbeats in the stage: the client hears heartbeats, not silence.
    server = serve(servers, tmp_path, stages, converted, "sleeps", "--heartbeat", "0.4", "--status-interval", "0.5",
                   TEST_STAGE_SECONDS="2.0")
    with ServerDataStream(None, host="127.0.0.1", port=server.port, rank=0, world_size=1, heartbeat=0.4, timeout=30,
                          hwm=2) as stream:
        epoch = stream.get_epoch_iterator(as_dict=True)
        got = [next(epoch)["sample_id"] for _ in range(2)]
        assert stream.reconnects == 0, f"the client reconnected {stream.reconnects} times:\n{server.log()}"
    log = server.log()
    assert len(np.concatenate(got)) == 16
    assert "dropped: silent" not in log, log
    # One warning naming the stage, and the time it takes in the status lines.
    assert log.count("stage usr_stages:sleeps has been running for") == 1, log
    server.wait_log(r"stages per batch: usr_stages:sleeps 2\.\d+ s")


def test_a_client_whose_batches_wait_in_a_stage_holds_up_no_other(
        converted: Path, servers: list, tmp_path: Path, stages: Path) -> None:
    server = serve(servers, tmp_path, stages, converted, "val_waits", "--heartbeat", "0.4")
    val_batches: list = []
    val_errors: list = []
    val_stream = ServerDataStream(None, host="127.0.0.1", port=server.port, split="val", rank=0, world_size=1,
                                  heartbeat=0.4, timeout=60)

    def read_val() -> None:
        try:
            for batch in val_stream.get_epoch_iterator(as_dict=True):
                val_batches.append(batch["sample_id"])
        except Exception as exc:  # (reported by the test below)
            val_errors.append(exc)

    reader = threading.Thread(target=read_val, daemon=True)
    reader.start()
    try:
        # While the val client's first batch is in the stage, waiting on the gate...
        wait_until((tmp_path / "gate.entered").exists, 30, "a val batch in the stage")
        # ...a train client reads two whole epochs,
        with ServerDataStream(None, host="127.0.0.1", port=server.port, split="train", rank=0, world_size=1,
                              heartbeat=0.4, timeout=10) as train:
            for _ in range(2):
                ids = np.concatenate([b[train.sources.index("sample_id")] for b in train.get_epoch_iterator()])
                assert len(np.unique(ids)) == len(ids) > 0
            assert train.reconnects == 0
        # and the val client waits on, for over 3 heartbeats, warned of once.
        server.wait_log(r"stage usr_stages:val_waits has been running for .* split 'val'", timeout=30)
        assert not val_batches, "a val batch left the stage before its gate opened"
        (tmp_path / "gate").touch()
        reader.join(30)
        assert not reader.is_alive(), "the val client's epoch did not end within 30 s of the gate opening"
        assert not val_errors, val_errors
        assert val_batches and val_stream.reconnects == 0, (len(val_batches), val_stream.reconnects)
    finally:
        (tmp_path / "gate").touch()
        val_stream.close()
    assert "dropped: silent" not in server.log()


def test_sigterm_ends_a_server_whose_stage_hangs_and_names_the_stage(
        converted: Path, servers: list, tmp_path: Path, stages: Path) -> None:
    server = serve(servers, tmp_path, stages, converted, "hangs", "--heartbeat", "0.4")
    # The client asks for a batch, and keeps asking for 5 s after the server is gone.
    stream = ServerDataStream(None, host="127.0.0.1", port=server.port, rank=0, world_size=1, heartbeat=0.4, timeout=5)
    ended: list[BaseException] = []

    def ask() -> None:
        try:
            next(iter(stream.get_epoch_iterator()), None)
        except Exception as exc:  # (asserted below: the server it asked is gone)
            ended.append(exc)

    asked = threading.Thread(target=ask, daemon=True)
    try:
        asked.start()
        wait_until((tmp_path / "gate.entered").exists, 30, "a batch in the hanging stage")
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(STOP_DEADLINE + 5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server outlived SIGTERM by {STOP_DEADLINE + 5} s with a hanging stage:\n{server.log()}")
        took = time.monotonic() - started
        asked.join(30)
    finally:
        stream.close()
    assert not asked.is_alive() and len(ended) == 1 and isinstance(ended[0], ServerUnavailable), ended
    log = server.log()
    assert code == 0, log
    assert took < STOP_DEADLINE, (took, log)
    assert "stopping without stage usr_stages:hangs, abandoned after" in log, log
