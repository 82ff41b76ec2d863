"""The peers benchmark's CPU time of a reader's process tree resolves what a quick round spends:
a few milliseconds, not the kernel's 10 ms clock ticks of /proc/PID/stat."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.peers.readerlib import ProcTree

BURN = """
import sys, time
start = time.process_time()
while time.process_time() - start < {seconds}:
    pass
sys.stdout.write("done\\n"); sys.stdout.flush()
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_a_childs_few_milliseconds_of_cpu_show_in_the_trees_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()" + BURN.format(seconds=0.015)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "ready\n"  # (its start-up spent, it waits for the word)
        tree = ProcTree(child.pid)
        before = tree.cpu_seconds()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        spent = tree.cpu_seconds() - before
    finally:
        child.kill()
        child.wait(timeout=10)
    # The child burnt 15 ms after the first reading (and a little more to write): whole ticks would read 0.01 or
    # 0.02 and the like.
    assert 0.015 <= spent < 0.019, spent
