"""``kill -USR1 PID``: a data server or a trainer rank that seems stuck writes where each of its
threads is to its stderr, and goes on."""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from fuelline.client import ServerDataStream
from fuelline.protocol.common.stacks import dump_stacks_on_usr1

from support.processes import wait_until

TIMEOUT = 30.0


def test_a_server_told_usr1_writes_every_threads_stack_and_goes_on_serving(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--status-interval", "0")
    os.kill(server.proc.pid, signal.SIGUSR1)
    # ("Current thread" where the signal found the thread holding the interpreter lock, "Thread" else.)
    server.wait_log(r"(?s)[Tt]hread 0x[0-9a-f]+ \(most recent call first\):.*serve_forever", timeout=TIMEOUT)
    assert server.proc.poll() is None
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
        assert len(next(iter(stream.get_epoch_iterator()))[0]) > 0


def test_a_trainer_waiting_on_a_silent_server_told_usr1_shows_where_it_waits(tmp_path: Path, zmq_context: zmq.Context) -> None:
    pytest.importorskip("torch")
    silent = zmq_context.socket(zmq.ROUTER)  # takes every Hello, answers none
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    err = tmp_path / "trainer.err"
    with open(err, "w") as stderr:
        trainer = subprocess.Popen([sys.executable, "-m", "fuelline.trainer", "--servers", f"127.0.0.1:{port}",
                                    "--width", "8", "--epochs", "1"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        assert silent.poll(int(TIMEOUT * 1000)), "the trainer never said Hello"
        silent.recv_multipart()
        # Its Hello goes out just before it waits for the Welcome: a dump taken in between shows
        # it still on its way there, so ask again (each dump written whole before the next).
        dumps = 0

        def dumped_waiting() -> bool:
            nonlocal dumps
            text = err.read_text()
            if text.count("(most recent call first)") >= dumps:
                if "wait_welcome" in text:
                    return True
                trainer.send_signal(signal.SIGUSR1)
                dumps = text.count("(most recent call first)") + 1
            return False

        wait_until(dumped_waiting, TIMEOUT, "a stack of the trainer waiting for its Welcome")
        stacks = err.read_text()
        assert "fl-keepalive" in stacks or "_keep_alive" in stacks, stacks  # every thread, not only the main one
        assert trainer.poll() is None, stacks  # and it goes on
    finally:
        trainer.kill()
        trainer.wait(TIMEOUT)


def test_a_process_whose_stderr_was_replaced_by_one_without_a_file_uses_its_own_or_none(monkeypatch) -> None:
    # (A command run in-process under a captured stderr, a notebook's.)
    try:
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        assert dump_stacks_on_usr1() is True  # (sys.__stderr__)
        monkeypatch.setattr(sys, "__stderr__", io.StringIO())
        assert dump_stacks_on_usr1() is False
        monkeypatch.setattr(sys, "__stderr__", None)
        assert dump_stacks_on_usr1() is False
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # (the handler there was before, back)
