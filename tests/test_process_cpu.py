"""``process_cpu_seconds``: the CPU time ``fuelline bench`` and the benchmarks charge to a server
process. It must count every thread the process ran, ended ones included, to well under a clock
tick: a short epoch of a small data set costs a server a few milliseconds."""

from __future__ import annotations

import select
import subprocess
import sys
import textwrap

import pytest

from fuelline.protocol.common.cpu import process_cpu_seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux CPU clocks and /proc")

READ_TIMEOUT_S = 30.0

# Burns CPU on a thread that then ends, prints its own CPU time (every thread, ended ones
# included) and blocks until its stdin closes.
BURN_THEN_WAIT = textwrap.dedent("""
    import sys, threading, time
    def burn(until):
        while time.process_time() < until:
            pass
    worker = threading.Thread(target=burn, args=(time.process_time() + {burn},))
    worker.start()
    worker.join()
    print(repr(time.process_time()), flush=True)
    sys.stdin.read()
""")


def _start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READ_TIMEOUT_S)
    assert ready, f"the child printed nothing within {READ_TIMEOUT_S:.0f}s"
    return proc.stdout.readline()


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=READ_TIMEOUT_S)


def test_counts_an_ended_thread_to_well_under_a_clock_tick() -> None:
    # 15.5 ms: half a tick past a multiple of 10 ms, which a count in ticks cannot read.
    proc = _start(BURN_THEN_WAIT.format(burn=0.0155))
    try:
        own = float(_read_line(proc))
        seen = process_cpu_seconds(proc.pid)
    finally:
        _finish(proc)
    assert seen is not None
    # What the child did between reading its clock and blocking (a print) is microseconds.
    assert own - 1e-6 <= seen <= own + 0.003, (own, seen)


def test_counts_a_live_child_process() -> None:
    grandchild = BURN_THEN_WAIT.format(burn=0.03)
    child = textwrap.dedent(f"""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {grandchild!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        print(p.stdout.readline().strip(), flush=True)
        sys.stdin.read()
        p.stdin.close()
        p.wait()
    """)
    proc = _start(child)
    try:
        grandchild_own = float(_read_line(proc))
        # (The child alone first: CPU clocks only go forward, so the sum read after cannot be less.)
        without = process_cpu_seconds(proc.pid, skip=frozenset(_children_of(proc.pid)))
        seen = process_cpu_seconds(proc.pid)
    finally:
        _finish(proc)
    assert seen is not None and without is not None
    assert seen >= grandchild_own + without - 1e-6, (seen, grandchild_own, without)


def test_a_process_that_is_gone_has_no_figure() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=READ_TIMEOUT_S)
    assert process_cpu_seconds(proc.pid) is None


def _children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]
