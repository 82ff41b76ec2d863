"""Connection churn against a live server, while a well-behaved client streams an epoch beside it:
thousands of connect/disconnect cycles and mute clients leave no sessions, threads or memory.

DESIGN.md promises (Safety, Liveness, Flow control): a malformed message gets an Error reply or is
dropped and never takes the server down; a server drops dead and silent clients' sessions and
their buffers, so its memory stays bounded; and none of this costs an honest client a batch. Each
test here attacks a real ``fuelline serve`` process over loopback and then checks exactly that:
the honest client's epoch is complete and exact, the server is alive and serves a newcomer, and
its sessions, threads and memory came back.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import zmq

from fuelline.protocol import Hello, Welcome

from support.hostile import (
    DROPPED,
    REPLY_WAIT,
    HonestReader,
    Peer,
    assert_serves_a_newcomer,
    frames_of,
    thread_count,
)
from support.metrics import metrics_port, scrape
from support.processes import RssSampler, rss_mb


def sessions_held(port: int) -> set[str]:
    """The clients the server holds a session for now, from its metrics."""
    return {dict(labels)["client"] for (name, labels), _ in scrape(port).items() if name == "fuelline_client_credit"}


def attackers_held(port: int) -> set[str]:
    return {name for name in sessions_held(port) if name.startswith(("mute-", "churn-"))}


@pytest.mark.timeout(90)
def test_connection_churn_leaves_no_sessions_and_no_memory_behind(
    sample_dataset: Path, start_serve, zmq_context: zmq.Context
) -> None:
    heartbeat = 0.2
    # Every peer connects from 127.0.0.1: the per-address cap is lifted to the server's, so that
    # the churn's sessions, until their disconnects are seen, never fill the address's places and
    # take the mute clients' (which a full server gives up; test_admission_* tests that).
    server = start_serve(sample_dataset, "--batch-size", "64", "--hwm", "4", "--heartbeat", str(heartbeat),
                         "--metrics-port", "0", "--max-clients-per-peer", "256")
    port = metrics_port(server)
    attack_over = threading.Event()
    honest = HonestReader(server.endpoint, attack_over)
    honest.start()
    assert honest.started_streaming.wait(20.0) and honest.error is None, f"no first batch: {honest.error!r}"
    rss = RssSampler(server.proc.pid)
    threads_before = thread_count(server.proc.pid)  # the honest session's producer among them

    # Mute clients: welcomed, then they say nothing, so only silence can end their sessions.
    mute = [Peer(zmq_context, server.endpoint) for _ in range(20)]
    try:
        for i, peer in enumerate(mute):
            peer.send(frames_of(Hello(f"mute-{i}", credit=0, heartbeat=heartbeat)))
        assert all(isinstance(peer.reply(), Welcome) for peer in mute)

        cycles, start = 0, time.monotonic()
        try:
            while cycles < 2000 and time.monotonic() - start < 20.0:
                peer = Peer(zmq_context, server.endpoint)
                peer.send(frames_of(Hello(f"churn-{cycles}", credit=cycles % 5, heartbeat=heartbeat)))
                if cycles % 2:
                    peer.reply(REPLY_WAIT)  # half wait for their Welcome, half leave at once
                peer.close()
                cycles += 1
        finally:
            attack_over.set()
        churn_seconds = time.monotonic() - start
        assert cycles == 2000, f"only {cycles} connect/disconnect cycles in {churn_seconds:.1f}s"

        # Every welcomed session is dropped within 3 heartbeat intervals (plus a tick, and the time
        # a busy 2-core box needs to get there): disconnected, or silent for the mute ones.
        # What the server holds is read from its own session table (the metrics), not its log:
        # at most the honest reader's session may remain (it may have finished its epoch).
        deadline = time.monotonic() + 3 * heartbeat + 5.0
        while (stale := attackers_held(port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not stale, f"{len(stale)} sessions never dropped, e.g. {sorted(stale)[:5]}"
        assert len(sessions_held(port)) <= 1
        silent = [float(t) for t in re.findall(r"client mute-\d+#\w+ dropped: silent for ([\d.]+)s", server.log())]
        assert len(silent) == len(mute), f"{len(silent)} of {len(mute)} mute clients dropped for silence"
        # (The log rounds to 0.1 s: a drop after 0.6004 s reads "0.6".)
        assert min(silent) >= round(3 * heartbeat, 1), f"a mute client was dropped before 3 intervals: {silent}"
    finally:
        for peer in mute:
            peer.close()

    honest.check_complete_epoch()
    assert server.proc.poll() is None, f"the server died:\n{server.log()[-3000:]}"
    assert_serves_a_newcomer(zmq_context, server.endpoint)
    text = server.log()
    reasons = [why for _, why in DROPPED.findall(text)]
    assert reasons.count("disconnected") >= 1000, f"drops by reason: {sorted(set(reasons))}, {len(reasons)} in all"
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    # A dropped session's producer finishes the row groups it is decoding before it sees the stop,
    # so after a burst the server works off a backlog for a few seconds; then all must be gone.
    # The source's read-ahead pool starts its threads lazily (up to min(4, cores)) and keeps them,
    # so it may have grown by that much; a leak would leave hundreds (one per session).
    pool = min(4, os.cpu_count() or 1)
    deadline = time.monotonic() + 20.0
    while (threads := thread_count(server.proc.pid)) > threads_before + pool and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threads <= threads_before + pool, f"{threads} server threads remain, {threads_before} before the churn"
    rss_peak, rss_after = rss.stop(), rss_mb(server.proc.pid)
    # +100 MB: every session's batches and blocks are freed when it is dropped; what may stay is
    # allocator slack (glibc keeps per-thread arenas after ~1000 producer threads came and went)
    # and libzmq's pipe pools. A leak of the sessions would not fit: ~1000 welcomed sessions ×
    # (2 × hwm batches + memory_per_client, ~0.76 MB) is ~0.8 GB.
    assert rss_after - rss.baseline < 100, f"server RSS grew {rss.baseline:.0f} -> {rss_after:.0f} MB"
    print(
        f"\nchurn: {cycles} cycles in {churn_seconds:.1f}s; {len(reasons)} sessions dropped "
        f"({reasons.count('disconnected')} disconnected, {reasons.count('silent')} silent); "
        f"server RSS {rss.baseline:.0f} MB before, {rss_peak:.0f} MB peak, {rss_after:.0f} MB after"
    )
