"""The suite's process watcher (tests/support/strays.py), run on a tiny suite of its own in a
pytest subprocess: a process a test leaves running is reported with the test that started it and
killed, whether it is pytest's child, in a session of its own, or orphaned in such a session; a
process the suite did not start is left alone; and a pytest that dies without finishing has its
processes killed by the watcher all the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from support.processes import wait_until

TESTS = Path(__file__).resolve().parent
RUN_TIMEOUT = 60.0
WAIT = 15.0

SUITE = """
    import os, subprocess, sys

    SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]

    def record(name, pid):
        with open(os.path.join({out!r}, name), "w") as f:
            f.write(str(pid))

    def test_leaves_a_child():
        record("child", subprocess.Popen(SLEEP).pid)

    def test_leaves_a_session():
        record("session", subprocess.Popen(SLEEP, start_new_session=True).pid)

    def test_leaves_an_orphan_in_a_session():
        # A launcher in a session of its own starts a sleeper and exits at once: the sleeper is
        # re-parented away from pytest before any scan may have seen it.
        code = ("import subprocess; print(subprocess.Popen({sleep!r}, stdout=subprocess.DEVNULL, "
                "stderr=subprocess.DEVNULL).pid)")
        launcher = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  start_new_session=True, timeout=30)
        record("orphan", int(launcher.stdout))

    def test_clean():
        subprocess.run([sys.executable, "-c", "pass"], timeout=30)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _pytest(tmp_path: Path, code: str, *options: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "support.strays",
                           *options, "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env, cwd=tmp_path)


def test_processes_a_test_left_running_are_reported_killed_and_fail_the_run(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    out.mkdir()
    # Not the inner suite's: started here, it must survive the inner run's sweep.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
        run = _pytest(tmp_path, SUITE.format(out=str(out), sleep=sleep))
        text = run.stdout + run.stderr
        assert "4 passed" in text, text
        assert run.returncode == 1, text  # every test passed; what they left fails the run
        pids = {name: int((out / name).read_text()) for name in ("child", "session", "orphan")}
        assert "3 processes the tests started were still running at the end, and were killed" in text, text
        for name, pid in pids.items():
            assert f"pid {pid} (" in text, f"{name} {pid} not reported:\n{text}"
            assert not _alive(pid), f"the {name} {pid} was left running"
        assert "first seen during test_tiny.py::test_leaves_a_child" in text, text
        assert "in a session the suite started" in text, text
        assert _alive(bystander.pid), "the watcher killed a process the suite did not start"
    finally:
        bystander.kill()
        bystander.wait(WAIT)


def test_a_suite_that_leaves_nothing_passes(tmp_path: Path) -> None:
    run = _pytest(tmp_path, """
        import subprocess, sys

        def test_waits_for_its_child():
            subprocess.run([sys.executable, "-c", "pass"], timeout=30)
    """)
    assert run.returncode == 0 and "were still running" not in run.stdout, run.stdout + run.stderr


def test_processes_of_a_pytest_that_died_are_killed_by_the_watcher(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    out.mkdir()
    run = _pytest(tmp_path, f"""
        import os, subprocess, sys

        def test_dies():
            pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                   start_new_session=True).pid
            with open(os.path.join({str(out)!r}, "pid"), "w") as f:
                f.write(str(pid))
            os._exit(3)  # as pytest-timeout's thread method, or a crash, ends a run
    """)
    assert run.returncode == 3, run.stdout + run.stderr
    pid = int((out / "pid").read_text())
    try:
        wait_until(lambda: not _alive(pid), WAIT, "the watcher kills what a dead pytest left")
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_in_worker_processes_a_left_process_is_killed_and_a_workers_own_helpers_are_not_strays(tmp_path: Path) -> None:
    """Run by pytest-xdist's workers (as tests/run.sh runs the suite), the watcher is the
    controller's: what a test leaves is still reported and killed, while each worker's
    multiprocessing resource tracker, which ends just after its worker, is waited for."""
    out = tmp_path / "pids"
    out.mkdir()
    run = _pytest(tmp_path, f"""
        import os, subprocess, sys
        from multiprocessing import resource_tracker, shared_memory

        def test_starts_its_workers_tracker():
            # Segments never unlinked: the tracker removes them (and warns of each) as it ends, so
            # it outlives its worker for a moment.
            for _ in range(200):
                shared_memory.SharedMemory(create=True, size=4096).close()
            assert resource_tracker._resource_tracker._pid is not None

        def test_also_starts_one():
            test_starts_its_workers_tracker()

        def test_leaves_a_child():
            pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid
            with open(os.path.join({str(out)!r}, "child"), "w") as f:
                f.write(str(pid))
    """, "-n", "2")
    text = run.stdout + run.stderr
    assert "3 passed" in text, text
    pid = int((out / "child").read_text())
    assert "1 processes the tests started were still running at the end, and were killed" in text, text
    assert f"pid {pid} (" in text and "import main" not in text, text  # (the tracker's command line)
    assert not _alive(pid), f"the child {pid} was left running"


def test_a_process_pytest_named_just_before_it_died_is_killed(tmp_path: Path) -> None:
    """pytest names each process it starts to the watcher; if it dies at once after, the watcher may
    see it gone before it reads that line. The line must still be read: the process may be known
    from nothing else (here a sleeper whose launcher, in a session of its own, exited before any
    scan). The watcher's root is a process that is not its parent, so it finds pytest gone on its
    first look, with the line already waiting on its stdin."""
    from support.strays import _read, child_line

    code = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert launcher.stdout is not None
    sleeper = int(launcher.stdout.readline())
    leader = _read(launcher.pid)  # (a zombie until reaped: still readable)
    launcher.wait(WAIT)
    assert leader is not None and _alive(sleeper)
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    said, stdin = os.pipe()
    os.write(stdin, (child_line(leader) + "\n").encode())
    os.close(stdin)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        watcher = subprocess.run([sys.executable, "-m", "support.strays", str(root.pid)], stdin=said,
                                 capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
        assert watcher.returncode == 0, watcher.stderr
        assert f"killed 1 processes it left: {sleeper} " in watcher.stderr, watcher.stderr
        wait_until(lambda: not _alive(sleeper), WAIT, "the watcher kills the process pytest named before it died")
        assert _alive(root.pid), "the watcher killed a process the suite did not start"
    finally:
        os.close(said)
        root.kill()
        root.wait(WAIT)
        if _alive(sleeper):
            os.kill(sleeper, signal.SIGKILL)
