"""A server's busy threads carry their role as their name in the operating system (``top -H``,
py-spy, perf, /proc), where Python 3.11 would leave every one of them ``python``."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol.common.threadnames import MAX_NAME_BYTES, name_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from Linux /proc")

TIMEOUT = 20.0


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # (a thread that ended meanwhile)
            pass
    return names


def test_a_thread_names_itself_and_a_long_name_is_cut_to_what_linux_keeps() -> None:
    seen: dict[str, str] = {}

    def named(name: str) -> None:
        name_this_thread(name)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen[name] = f.read().strip()

    for name in ("fl-produce", "a-name-longer-than-linux-keeps"):
        thread = threading.Thread(target=named, args=(name,))
        thread.start()
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    assert seen == {"fl-produce": "fl-produce", "a-name-longer-than-linux-keeps": "a-name-longer-t"}
    assert len(seen["a-name-longer-than-linux-keeps"]) == MAX_NAME_BYTES
    # The caller's own name is left as it was.
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        assert f.read().strip() not in seen.values()


def test_a_serving_process_names_its_read_ahead_threads_and_has_no_producer_for_a_unit_source(
        sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT, hwm=2) as stream:
        next(iter(stream.get_epoch_iterator()))
        during = _thread_names(server.proc.pid)
    # (Its batches are prepared by the serving loop, the process's main thread.)
    assert "fl-read" in during and "fl-produce" not in during, during


def test_a_fuel_stream_servers_producer_thread_is_named(start_script) -> None:
    server = start_script("""
import numpy as np
from fuelline.server import start_server

class Stream:
    sources = ("x",)
    def get_epoch_iterator(self, **kwargs):
        return iter([(np.arange(4),)] * 1000)

start_server(Stream(), port=0, hwm=2)
""")
    before = _thread_names(server.proc.pid)
    assert "fl-produce" not in before  # a producer starts with a client's first credit
    with ServerDataStream(None, endpoints=[server.endpoint], timeout=TIMEOUT, hwm=2) as stream:
        next(iter(stream.get_epoch_iterator()))
        during = _thread_names(server.proc.pid)
    assert "fl-produce" in during, during
