"""No test leaves a process behind: a pytest plugin that finds every process the suite started and
ends the run by killing those still alive, failing it if there were any.

A watcher process (``python -m support.strays PID``, in a session of its own so that a Ctrl-C
meant for pytest does not end it first) scans /proc every ``SCAN_S`` seconds and records the
descendants of the pytest process (parent-pid chains), each with its start time (so a reused pid
is never taken for it), and the sessions and process groups they lead. A process is the suite's if
it descends from pytest now, or was seen descending from it, or lives in a session or group that
one of those leads (a torchrun rank, a ``start_new_session`` launcher's children, even orphaned
before a scan saw them: pytest tells the watcher of each process it starts itself, with the
session or group it leads). Nothing else on the machine is touched.

When the session finishes (after every fixture, session-scoped ones too, was torn down), pytest
asks the watcher; it does a last scan, sends SIGTERM to what is left, SIGKILL after
``TERM_GRACE_S``, and answers with what it found; the run then fails, naming each process and the
test that was running when it was first seen. If pytest dies without asking (killed, ``os._exit``),
the watcher notices its parent is gone and kills what it recorded all the same.

Under pytest-xdist the watcher is the controller's, and sees the workers' processes as its
descendants; each worker names its own multiprocessing helpers as it finishes, and the sweep waits
for those to end with it. A process is then attributed to a test running when it was first seen,
in whichever worker.

What it cannot see: a process started and orphaned within one scan interval by a grandchild of
pytest, and left in pytest's own session and group, or in a session whose leader also came and
went within that interval.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import pytest

__all__ = ["SCAN_S", "TERM_GRACE_S", "Stray", "Watcher"]

SCAN_S = 0.1  # how often the watcher looks for new processes
TERM_GRACE_S = 3.0  # between SIGTERM and SIGKILL for a process left behind
HELPER_GRACE_S = 5.0  # for the helpers of a worker process that ended to end too
ANSWER_S = 20.0  # how long pytest waits for the watcher's answer


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks after boot: with the pid, names a process once
    state: str


@dataclass(frozen=True)
class Stray:
    """A process the suite left running, and how it was found."""

    pid: int
    cmdline: str
    seen_during: str  # the test running when it was first seen ("" before the first test)
    found: str  # "descends from pytest", "seen descending from pytest", "in a session the suite started"…
    killed: bool


def _read(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # (the command name may hold spaces and parentheses)
    return _Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0])


def _table() -> dict[int, _Proc]:
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = _read(int(entry))
            if proc is not None:
                procs[proc.pid] = proc
    return procs


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def _alive(proc: _Proc, table: dict[int, _Proc]) -> bool:
    """The same process is still there and has not exited (a zombie only waits to be reaped)."""
    now = table.get(proc.pid)
    return now is not None and now.start == proc.start and now.state not in ("Z", "X")


def _descendants(root: int, table: dict[int, _Proc]) -> Iterator[_Proc]:
    children: dict[int, list[_Proc]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc)
    todo = list(children.get(root, ()))
    while todo:
        proc = todo.pop()
        yield proc
        todo.extend(children.get(proc.pid, ()))


class _Watch:
    """The watcher's records (it runs in its own process: ``main``)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.me = os.getpid()
        self.test = ""
        self.seen: dict[int, tuple[_Proc, str, str]] = {}  # pid -> (process, test, command line)
        self.groups: dict[tuple[str, int], int] = {}  # ("sid"|"pgid", id) -> its leader's start
        self.spare: set[int] = set()  # pytest's own helpers, which end with it
        # The helpers of a worker process of pytest-xdist's, which end soon after it: given
        # HELPER_GRACE_S to do so before the sweep counts them.
        self.helpers: list[_Proc] = []

    def scan(self) -> dict[int, _Proc]:
        table = _table()
        for proc in _descendants(self.root, table):
            if proc.pid != self.me:
                self.note(proc)
        return table

    def note(self, proc: _Proc) -> None:
        """A process of the suite's, seen by a scan or reported by pytest as its child."""
        known = self.seen.get(proc.pid)
        if known is None or known[0].start != proc.start:
            self.seen[proc.pid] = (proc, self.test, _cmdline(proc.pid))
        # A session or group one of them leads is the suite's: whatever joins it later too.
        if proc.sid == proc.pid:
            self.groups[("sid", proc.sid)] = proc.start
        if proc.pgid == proc.pid:
            self.groups[("pgid", proc.pgid)] = proc.start

    def left(self, table: dict[int, _Proc]) -> dict[int, tuple[_Proc, str]]:
        """The suite's processes alive in ``table``, with how each was found."""
        out: dict[int, tuple[_Proc, str]] = {}
        for proc in _descendants(self.root, table):
            if proc.pid != self.me and proc.state not in ("Z", "X"):
                out[proc.pid] = (proc, "descends from pytest")
        for proc, _, _ in self.seen.values():
            if proc.pid not in out and _alive(proc, table):
                out[proc.pid] = (table[proc.pid], "seen descending from pytest, then orphaned")
        for proc in table.values():
            if proc.pid in out or proc.pid in (self.me, self.root) or proc.state in ("Z", "X"):
                continue
            for kind, group in (("sid", proc.sid), ("pgid", proc.pgid)):
                leader_start = self.groups.get((kind, group))
                # (A member starts after its leader; a pid reused since is no member.)
                if leader_start is not None and proc.start >= leader_start:
                    out[proc.pid] = (proc, f"in a {'session' if kind == 'sid' else 'process group'} "
                                           f"the suite started ({group})")
                    break
        return out

    def sweep(self) -> list[Stray]:
        """Kill what the suite left: SIGTERM, then SIGKILL; a killed process's children (never
        seen, but in the suite's sessions) are found on the next round."""
        deadline = time.monotonic() + HELPER_GRACE_S
        while any(_alive(p, _table_of(p.pid)) for p in self.helpers) and time.monotonic() < deadline:
            time.sleep(0.02)  # (waiting for processes to exit: the deadline bounds it)
        strays: dict[int, Stray] = {}
        for _ in range(3):
            table = self.scan()
            left = self.left(table)
            left = {pid: found for pid, found in left.items() if pid not in self.spare}
            if not left:
                break
            for pid, (_, found) in left.items():
                if pid not in strays:
                    test = self.seen[pid][1] if pid in self.seen else ""
                    cmd = self.seen[pid][2] if pid in self.seen else _cmdline(pid)
                    strays[pid] = Stray(pid, cmd, test, found, killed=False)
            for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, TERM_GRACE_S)):
                for pid, (proc, _) in left.items():
                    if _alive(proc, _table_of(pid)):
                        try:
                            os.kill(pid, sig)
                        except OSError:
                            pass
                deadline = time.monotonic() + grace
                while any(_alive(p, _table_of(p.pid)) for p, _ in left.values()) and time.monotonic() < deadline:
                    time.sleep(0.02)  # (waiting for processes to exit: the deadline bounds it)
            for pid, (proc, _) in left.items():
                strays[pid] = Stray(**{**asdict(strays[pid]), "killed": not _alive(proc, _table_of(pid))})
        return list(strays.values())


def _table_of(pid: int) -> dict[int, _Proc]:
    proc = _read(pid)
    return {} if proc is None else {pid: proc}


def child_line(proc: _Proc) -> str:
    """What pytest tells the watcher of a process it started (read back by ``_obey``)."""
    return f"child {proc.pid} {proc.ppid} {proc.pgid} {proc.sid} {proc.start}"


def _obey(watch: _Watch, line: bytes) -> bool:
    """Carry out one line from pytest; True for ``finish``."""
    command, _, arg = line.decode(errors="replace").partition(" ")
    if command == "test":
        watch.test = arg
    elif command == "spare":
        watch.spare.add(int(arg))
    elif command == "helper":
        helper = _read(int(arg))
        if helper is not None:
            watch.helpers.append(helper)
    elif command == "child":
        pid, ppid, pgid, sid, start = map(int, arg.split())
        watch.note(_Proc(pid, ppid, pgid, sid, start, "?"))
    return command == "finish"


def main(root: int) -> int:
    """The watcher: scans until pytest asks (``finish`` on stdin) or dies; then sweeps."""
    watch = _Watch(root)
    watch.scan()
    print("ready", flush=True)
    stdin = sys.stdin.buffer.fileno()
    pending = b""
    while True:
        # pytest gone without asking: what it said before it went is read first (a process it
        # started just before it died may be known from nothing else), then all is cleaned up.
        gone = os.getppid() != root
        ready, _, _ = select.select([stdin], [], [], 0 if gone else SCAN_S)
        data = os.read(stdin, 65536) if ready else b""
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if _obey(watch, line):
                print(json.dumps([asdict(s) for s in watch.sweep()]), flush=True)
                return 0
        if gone and not data:
            strays = watch.sweep()
            if strays:
                print(f"fuelline test watcher: pytest is gone; killed {len(strays)} processes it left: "
                      + "; ".join(f"{s.pid} {s.cmdline}" for s in strays), file=sys.stderr, flush=True)
            return 0
        if ready and not data:
            continue  # pytest closed its end: the parent check decides
        if not gone:
            watch.scan()


class Watcher:
    """pytest's side: starts the watcher, tells it which test runs, and asks it at the end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "support.strays", str(os.getpid())], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdout is not None
        # Its first scan is done before any test starts a process.
        if not select.select([self.proc.stdout], [], [], ANSWER_S)[0] or self.proc.stdout.readline() != b"ready\n":
            self.proc.kill()
            raise RuntimeError("the process watcher did not start")

    def tell(self, line: str) -> None:
        with self._lock:  # (tests start processes from several threads)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # (it died: ``finish`` says so)

    def started(self, pid: int) -> None:
        """pytest started ``pid``: its session or group is recorded even if it is gone before the
        next scan (a launcher in a session of its own that exits at once, leaving its children)."""
        proc = _read(pid)  # (readable until it is reaped, which its caller does later)
        if proc is not None:
            self.tell(child_line(proc))

    def finish(self) -> list[Stray]:
        self.tell("finish")
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], ANSWER_S)[0]:
            self.proc.kill()
            raise RuntimeError(f"the process watcher did not answer within {ANSWER_S}s")
        line = self.proc.stdout.readline()
        self.proc.wait(ANSWER_S)
        self.proc.stdout.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if not line:
            raise RuntimeError(f"the process watcher ended with {self.proc.returncode} before it answered")
        return [Stray(**s) for s in json.loads(line)]


# -- the plugin ----------------------------------------------------------------------------------
def _own_helpers() -> list[int]:
    """multiprocessing's helpers of the pytest process itself (its resource tracker, a fork
    server): started once by the first test that needs one, they serve the process for its
    lifetime and end when it does, so they are no test's leftovers."""
    pids = []
    for module, attr, field in (("multiprocessing.resource_tracker", "_resource_tracker", "_pid"),
                                ("multiprocessing.forkserver", "_forkserver", "_forkserver_pid")):
        helper = getattr(sys.modules.get(module), attr, None)
        pid = getattr(helper, field, None)
        if isinstance(pid, int):
            pids.append(pid)
    return pids


_watcher: Watcher | None = None


_popen_init = subprocess.Popen.__init__


def _popen_init_told(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    _popen_init(self, *args, **kwargs)
    if _watcher is not None:
        _watcher.started(self.pid)


def pytest_configure(config: pytest.Config) -> None:
    global _watcher
    if sys.platform.startswith("linux") and _watcher is None and not hasattr(config, "workerinput"):
        _watcher = Watcher()
        subprocess.Popen.__init__ = _popen_init_told  # type: ignore[method-assign]


def pytest_unconfigure() -> None:
    subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]


def pytest_runtest_logstart(nodeid: str) -> None:
    if _watcher is not None:
        _watcher.tell(f"test {nodeid}")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """A pytest-xdist worker ended: its multiprocessing helpers (which its own session finish
    named) end with it, and are waited for, not swept at once."""
    if _watcher is not None:
        for pid in getattr(node, "workeroutput", {}).get("fuelline_helpers", ()):
            _watcher.tell(f"helper {pid}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    global _watcher
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # (a pytest-xdist worker: the watcher is the controller's)
        workeroutput["fuelline_helpers"] = _own_helpers()
    if _watcher is None:
        return
    watcher, _watcher = _watcher, None
    watcher.tell("test (after the last test)")
    for pid in _own_helpers():
        watcher.tell(f"spare {pid}")
    try:
        strays = watcher.finish()
    except RuntimeError as exc:
        strays, problem = [], str(exc)
    else:
        problem = ""
    if not strays and not problem:
        return
    report = [f"the process watcher failed: {problem}"] if problem else []
    for s in strays:
        report.append(f"pid {s.pid} ({s.found}; first seen during {s.seen_during or 'start-up'}): "
                      f"{s.cmdline}{'' if s.killed else '  -- STILL ALIVE after SIGKILL'}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    title = f"{len(strays)} processes the tests started were still running at the end, and were killed"
    if reporter is not None:
        reporter.write_sep("=", title, red=True, bold=True)
        for line in report:
            reporter.write_line(line)
    else:
        print(title, *report, sep="\n", file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
