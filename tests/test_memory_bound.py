"""The memory bound the docs give (docs/concepts.md, "Memory bound"; docs/guarantees.md, Load) is
what the code allows: a real server, a client on its host reading through shared memory that
keeps every batch, and a TCP client, both asking for more than the server's hwm; the server's own
metrics and slab files never exceed the bound's terms. And the bound's constants are the code's."""

from __future__ import annotations

import glob
import inspect
import os
import re
from pathlib import Path

import numpy as np
import pytest

from fuelline.client import ServerDataStream
from fuelline.server.cache.memory import RecentBatches
from fuelline.server.serving import slabs
from fuelline.server.serving.local_ipc import default_base, on_memory_fs
from fuelline.server.serving.server import Server
from fuelline.server.sources.parquet import ParquetSource

from support.metrics import metrics_port, scrape
from support.processes import wait_until

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20.0
HWM = 2
BATCHES = 40  # more than a session's slabs: 3·hwm + 8 = 14
FORMULA = [
    "server memory ≤ sessions × (2·hwm·B + R)",
    "+ shm sessions × (3·hwm + 8)·S",
    "+ min(clients, 64) × (K + hwm)·B",
    "+ D",
]

# 640 KiB batches: one to a slab of 1 MiB, so the slab files count the batches the server lent.
SERVER = f"""
    import sys
    import numpy as np
    from fuelline.server.serving.metrics import serve_metrics
    from fuelline.server.serving.server import Server
    from fuelline.server.serving.start import serve_until_signalled
    from fuelline.server.sources.fuel import FuelStreamSource

    class Large:
        sources = ("x",)

        def get_epoch_iterator(self, **kwargs):
            for i in range({BATCHES}):
                yield (np.full((160, 1024), i, dtype=np.float32),)

    server = Server(FuelStreamSource(Large(), fresh_arrays=True), port=0, hwm={HWM}, heartbeat=5.0)
    print(f"metrics on http://127.0.0.1:{{serve_metrics(server, 0)}}/metrics", file=sys.stderr, flush=True)
    serve_until_signalled(server)
"""


def _needs_shared_memory() -> None:
    if not on_memory_fs(default_base()):
        pytest.skip(f"socket folders go to {default_base()}, which is not in memory: no shared memory here")


def _formula_of(page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    start = text.index("server memory ≤")
    block = text[start:text.index("```", start)]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_both_pages_give_the_same_bound(tmp_path: Path) -> None:
    assert _formula_of("concepts.md") == _formula_of("guarantees.md") == FORMULA
    assert "hwm × batch size × clients" not in (ROOT / "docs" / "guarantees.md").read_text()


def test_the_bounds_constants_are_the_codes(sample_dataset: Path) -> None:
    _needs_shared_memory()
    # The memory tier: K + hwm batches for each of at most 64 clients; a slab is at least 1 MiB.
    assert inspect.signature(RecentBatches).parameters["max_clients"].default == 64
    assert slabs.GRAIN == 1 << 20
    source = ParquetSource(str(sample_dataset), batch_size=100, seed=3)
    try:
        with Server(source, port=0, hwm=HWM, heartbeat=5.0, memory_cache=7) as server:
            assert server.recent is not None and (server.recent.k, server.recent.max_clients) == (7 + HWM, 64)
            with ServerDataStream(("sample_id",), endpoints=[server.endpoint.removeprefix("tcp://")], hwm=HWM,
                                  timeout=TIMEOUT, receive_timeout=TIMEOUT) as stream:
                next(iter(stream.get_epoch_iterator()))
                assert stream.transports[0].startswith("ipc://")
                (session,) = server.sessions.values()
                assert session.slabs is not None and session.slabs.max_slabs == 3 * HWM + 8
    finally:
        source.close()


def test_a_server_holds_no_more_than_the_bounds_terms(start_script, tmp_path: Path) -> None:
    _needs_shared_memory()
    server = start_script(SERVER)
    port = metrics_port(server)
    endpoint = [server.endpoint]
    # Both ask for more than the server's hwm: the server's decides.
    local = ServerDataStream(endpoints=endpoint, hwm=4 * HWM, timeout=TIMEOUT, receive_timeout=TIMEOUT)
    tcp = ServerDataStream(endpoints=endpoint, hwm=4 * HWM, timeout=TIMEOUT, receive_timeout=TIMEOUT, local=False)
    kept: list[np.ndarray] = []  # the local client keeps every batch: its slabs are never released
    most_slabs, most_held = 0, 0
    try:
        local_it, tcp_it = local.get_epoch_iterator(), tcp.get_epoch_iterator()
        for i in range(BATCHES):
            kept.append(next(local_it)[0])
            assert int(next(tcp_it)[0][0, 0]) == i
            if i == 0:
                assert local.transports[0].startswith("ipc://") and tcp.transports[0].startswith("tcp://")
                folder = Path(local.transports[0][len("ipc://"):]).parent
            slab_files = glob.glob(str(folder / "slab-*"))
            tags = {re.sub(r"-\d+$", "", os.path.basename(f)) for f in slab_files}
            assert len(tags) <= 1, f"slabs of more than the local session: {slab_files}"
            assert len(slab_files) <= 3 * HWM + 8, f"{len(slab_files)} slabs for one session with hwm {HWM}"
            most_slabs = max(most_slabs, len(slab_files))
            metrics = scrape(port)
            sessions = {dict(labels)["client"] for (name, labels) in metrics if name == "fuelline_client_in_flight"}
            assert len(sessions) >= 2, sessions  # (the local client's TCP session may linger as it moves)
            for client in sessions:
                flight = next(v for (name, labels), v in metrics.items()
                              if name == "fuelline_client_in_flight" and dict(labels)["client"] == client)
                queued = next(v for (name, labels), v in metrics.items()
                              if name == "fuelline_client_queue_depth" and dict(labels)["client"] == client)
                assert flight <= HWM and queued <= HWM, f"{client}: {flight} in flight, {queued} queued, hwm {HWM}"
                most_held = max(most_held, flight + queued)
        # The bound is reached, not merely respected: the kept batches filled the session's slabs
        # (the rest came through the socket), and a session held batches ahead of its client.
        wait_until(lambda: len(glob.glob(str(folder / "slab-*"))) == 3 * HWM + 8, TIMEOUT,
                   "the local session fills its slabs")
        assert most_slabs <= 3 * HWM + 8 and most_held > HWM, (most_slabs, most_held)
        assert [int(x[0, 0]) for x in kept] == list(range(BATCHES))
    finally:
        local.close()
        tcp.close()
