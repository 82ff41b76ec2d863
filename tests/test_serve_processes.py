"""``fuelline serve --processes N``: several serving processes behind one port, supervised.

Every process serves the same batches; the kernel spreads connections among them; a process that
dies is started again and its clients lose and repeat nothing; the processes go when their
supervisor goes, however it goes; a process that cannot start stops the rest.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuelline.client import ServerDataStream
from fuelline.client.agreement import idle_processes

from support.processes import ServerProcess, wait_until

ARGS = ("--batch-size", "40", "--heartbeat", "0.2", "--seed", "5", "--status-interval", "0")
STARTED = re.compile(r"serving process (\d+) started \(pid (\d+)\)")


def child_pids(server: ServerProcess) -> dict[int, int]:
    """The serving processes the supervisor said it started, latest pid of each."""
    return {int(k): int(pid) for k, pid in STARTED.findall(server.log())}


def gone(pid: int) -> bool:
    """Whether a process (not ours to reap) has exited: no longer listed, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{wanted}\}} (\S+)$", text, re.M)
    assert match, f"{name}{{{wanted}}} not in the metrics:\n{text}"
    return float(match.group(1))


def read_epoch(endpoint: str, rank: int = 0, world: int = 1, **kw) -> list[list[int]]:
    with ServerDataStream(("sample_id",), endpoints=[endpoint], rank=rank, world_size=world, timeout=30, **kw) as s:
        return [b[0].tolist() for b in s.get_epoch_iterator()]


def read_all_at_once(endpoint: str, world: int, **kw) -> dict[int, list[list[int]]]:
    """Ranks 0…world-1 each read one epoch of their share, all at once, on threads of their own."""
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def read(rank: int) -> None:
        try:
            got[rank] = read_epoch(endpoint, rank, world, **kw)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(got) == list(range(world)), errors
    return got


def test_clients_are_spread_over_the_processes_and_read_what_one_process_serves(sample_dataset: Path, start_serve) -> None:
    single = start_serve(sample_dataset, *ARGS)
    several = start_serve(sample_dataset, *ARGS, "--processes", "2", "--metrics-port", "0")
    metrics_port = int(re.search(r"metrics of the 2 serving processes on http://127.0.0.1:(\d+)/", several.log()).group(1))
    world = 24  # connections the kernel hands out by a hash: all 24 to one process has odds of 2 in 2**24
    got = read_all_at_once(several.endpoint, world, local=False)
    for rank in range(world):
        assert got[rank] == read_epoch(single.endpoint, rank, world), f"rank {rank} read other batches"
    text = metrics(metrics_port)
    sessions = [sample(text, "fuelline_sessions_total", process=str(k)) for k in range(2)]
    assert sum(sessions) == world and min(sessions) > 0, sessions
    assert [sample(text, "fuelline_serving_processes_up", process=str(k)) for k in range(2)] == [1.0, 1.0]


def test_clients_on_the_host_are_dealt_to_the_processes_in_turn(sample_dataset: Path, start_serve) -> None:
    """The kernel spreads connections by a hash, unevenly; a client on the host moves to the Unix
    socket its Welcome names, and the processes name one another's in turn: 8 clients, 4 and 4."""
    server = start_serve(sample_dataset, *ARGS, "--processes", "2", "--metrics-port", "0")
    metrics_port = int(re.search(r"on http://127.0.0.1:(\d+)/metrics", server.log()).group(1))
    got = read_all_at_once(server.endpoint, 8, hwm=2)
    assert all(len(batches) == 25 for batches in got.values())  # 8000 rows / 8 ranks / 40 a batch
    text = metrics(metrics_port)
    # Every batch went into shared memory (nothing over TCP); each process placed its 4 clients'
    # 25 batches, and at most the hwm (2) each read ahead into the next epoch before leaving.
    shared = [sample(text, "fuelline_batches_shared_total", process=str(k)) for k in range(2)]
    assert all(4 * 25 <= n <= 4 * 27 for n in shared), shared


@pytest.mark.parametrize("killed_after", [30, 200])  # batches: mid-epoch, and just at the first epoch's end
def test_a_killed_process_is_started_again_and_its_client_loses_and_repeats_nothing(
    sample_dataset: Path, start_serve, killed_after: int
) -> None:
    server = start_serve(sample_dataset, *ARGS, "--processes", "2", "--metrics-port", "0")
    metrics_port = int(re.search(r"on http://127.0.0.1:(\d+)/metrics", server.log()).group(1))
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=30) as s:
        expected = [b[0].tolist() for e in range(2) for b in s.get_epoch_iterator()]
    seen: list[list[int]] = []
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], hwm=4, heartbeat=0.2, timeout=30) as s:
        it = s.get_epoch_iterator()
        seen += [next(it)[0].tolist() for _ in range(killed_after)]
        text = metrics(metrics_port)
        # The process its batches come from (the one it said Hello to over TCP may be the other).
        serving = sorted({int(k) for k, sent in re.findall(
            r'^fuelline_client_batches_sent_total\{[^}]*process="(\d+)"[^}]*\} (\S+)$', text, re.M) if float(sent) > 0})
        assert len(serving) == 1, text
        victim = serving[0]
        pid = child_pids(server)[victim]
        subprocess.run(["kill", "-9", str(pid)], check=True, timeout=10)
        seen += [b[0].tolist() for b in it]
        seen += [b[0].tolist() for b in s.get_epoch_iterator()]
    assert seen == expected and len(seen) == 400
    log = server.wait_log(rf"serving process {victim} \(pid \d+\) serves again", timeout=30)
    assert f"serving process {victim} (pid {pid}) killed by signal SIGKILL; starting it again" in log
    assert child_pids(server)[victim] != pid


def test_one_reader_with_a_connection_to_each_process_is_served_by_both(sample_dataset: Path, start_serve) -> None:
    """``connections=2`` to a server of two processes: the reader's two sessions are dealt one to
    each process, and it reads what it reads from a server of one process over two connections."""
    single = start_serve(sample_dataset, *ARGS)
    server = start_serve(sample_dataset, *ARGS, "--processes", "2", "--metrics-port", "0")
    metrics_port = int(re.search(r"on http://127.0.0.1:(\d+)/metrics", server.log()).group(1))
    got = read_epoch(server.endpoint, connections=2, hwm=4)
    assert got == read_epoch(single.endpoint, connections=2, hwm=4)
    alone = read_epoch(single.endpoint)  # one connection: the same windows, every one once
    assert sorted(x for b in got for x in b) == sorted(x for b in alone for x in b)
    text = metrics(metrics_port)
    # Each process placed one connection's half of the batches (and what it read ahead).
    assert all(sample(text, "fuelline_batches_shared_total", process=str(k)) >= len(got) // 2 for k in range(2))

    # Stopped half-way, it goes on over one connection: nothing lost or repeated.
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], connections=2, hwm=4, timeout=30) as s:
        it = s.get_epoch_iterator()
        first = [next(it)[0].tolist() for _ in range(len(got) // 2 + 1)]
        state = s.state_dict()
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=30) as s:
        s.load_state_dict(state)
        rest = [b[0].tolist() for b in s.get_epoch_iterator()]
    assert sorted(x for b in first + rest for x in b) == sorted(x for b in alone for x in b)


def test_a_reader_with_fewer_connections_than_processes_is_told(sample_dataset: Path, start_serve, caplog) -> None:
    several = start_serve(sample_dataset, *ARGS, "--processes", "2")
    single = start_serve(sample_dataset, *ARGS)
    caplog.set_level(logging.INFO, logger="fuelline.client")
    hint = ("the data server has 2 serving processes, and 1 rank(s) read it over 1 connection(s) each: 1 of its "
            "processes prepare none of these batches; connections=2")
    with ServerDataStream(("sample_id",), endpoints=[several.endpoint], timeout=30) as s:
        next(iter(s.get_epoch_iterator()))  # (told from the first batch: the info need not be asked for)
        assert caplog.text.count(hint) == 1
        assert s.info["serving_processes"] == 2
    with ServerDataStream(("sample_id",), endpoints=[several.endpoint], split="val", timeout=30) as s:
        next(iter(s.get_epoch_iterator()))  # (another stream of the same reader: a trainer's val split)
    assert caplog.text.count(hint) == 1  # once a process
    caplog.clear()
    for endpoint, kw in ((several.endpoint, {"connections": 2}), (several.endpoint, {"rank": 0, "world_size": 2}),
                         (single.endpoint, {})):
        with ServerDataStream(("sample_id",), endpoints=[endpoint], timeout=30, **kw) as s:
            next(iter(s.get_epoch_iterator()))
            assert ("serving_processes" in s.info) == (endpoint == several.endpoint)
    assert "serving processes" not in caplog.text


@pytest.mark.parametrize("said", [[2], "2", 2.5, True, None, -3, {"a": 1}])
def test_a_servers_word_on_its_processes_that_is_not_a_whole_number_is_not_taken(said) -> None:
    """The Welcome's info is the server's word: one that lies there fails no reader, and tells it nothing."""
    honest, liar = SimpleNamespace(info={"serving_processes": 2}), SimpleNamespace(info={"serving_processes": said})
    assert idle_processes(["a", "b"], [liar, liar], 1) == ""
    assert idle_processes(["a", "b"], [honest, liar], 1).startswith("the data server has 2 serving processes")


@pytest.mark.parametrize("connections", [0, -1, 1.5, True])
def test_connections_must_be_a_whole_number_of_at_least_one(connections) -> None:
    with pytest.raises(ValueError, match="connections must be a whole number >= 1"):
        ServerDataStream(("sample_id",), endpoints=["127.0.0.1:1"], connections=connections)


def test_a_hung_process_is_killed_and_started_again_and_new_connections_are_answered(
    sample_dataset: Path, start_serve
) -> None:
    """A serving process that stops running but lives (stopped here; deadlocked alike) still holds
    its share of the port: the kernel would go on handing it connections nobody answers. Its
    serving loop is not heard any more (5 heartbeats, at least 3 s), so it is killed and started
    again; the other one, idle all along, is left alone."""
    server = start_serve(sample_dataset, *ARGS, "--processes", "2")
    pids = child_pids(server)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        log = server.wait_log(r"serving process 1 \(pid \d+\) serves again", timeout=30)
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    silent = re.search(rf"serving process 1 \(pid {pids[1]}\) has not run its serving loop for ([\d.]+) s", log)
    assert silent and 3.0 <= float(silent.group(1)) < 10.0, log
    assert f"serving process 1 (pid {pids[1]}) hung, and killed by signal SIGKILL; starting it again" in log
    assert child_pids(server)[0] == pids[0] and "serving process 0 (pid" not in log.split("started (pid")[-1]
    # Every connection is answered again: 12 clients over TCP, each reading its share without once
    # reconnecting (a client that met a mute process would, after 3 silent heartbeats).
    for rank in range(12):
        with ServerDataStream(("sample_id",), endpoints=[server.endpoint], rank=rank, world_size=12, timeout=30,
                              local=False) as s:
            assert sum(1 for _ in s.get_epoch_iterator()) == 17 and s.reconnects == 0, rank  # 8000 rows / 12 / 40


def test_the_processes_stop_with_their_supervisor_whether_terminated_or_killed(sample_dataset: Path, start_serve) -> None:
    terminated = start_serve(sample_dataset, *ARGS, "--processes", "2")
    killed = start_serve(sample_dataset, *ARGS, "--processes", "2")
    pids = child_pids(terminated)
    assert len(pids) == 2 and not any(gone(p) for p in pids.values())
    assert terminated.terminate(30) == 0
    assert all(gone(p) for p in pids.values())
    log = terminated.log()
    for k in range(2):
        assert re.search(rf"\[serving_process={k}\] INFO server stopped: server shutting down \(SIGTERM\)", log), log

    pids = child_pids(killed)
    argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
    group = Path(argv[argv.index(b"--serving-group") + 1].decode())  # where the processes meet
    assert group.is_dir()
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(10)
    wait_until(lambda: all(gone(p) for p in pids.values()), 20, "serving processes gone after their supervisor")
    assert not group.exists()  # removed by the processes, since their supervisor could not
    log = killed.log()
    for k in range(2):
        assert re.search(rf"\[serving_process={k}\] INFO server stopped: .*its supervisor is gone", log), log


def test_a_process_that_cannot_start_stops_the_others_and_says_so(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(tmp_path / "missing"), "--port", "0",
            "--processes", "2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert re.search(r"serving process \d \(pid \d+\) exited with code 2 before it served; its error is above",
                     done.stderr), done.stderr
    assert "missing" in done.stderr  # the process's own error names the dataset
    assert all(gone(int(p)) for _, p in STARTED.findall(done.stderr))


def test_a_port_held_by_a_process_that_does_not_share_it_is_refused(sample_dataset: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port", str(port),
                "--processes", "2"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "started" not in done.stderr  # refused before any process was started


def test_a_second_server_is_refused_the_port_that_another_one_shares(sample_dataset: Path, start_serve) -> None:
    """Sharing a port is for a supervisor's own processes: another server started on it by mistake
    (its own seed, its own data) must not be handed a share of the first one's clients."""
    first = start_serve(sample_dataset, *ARGS, "--processes", "2")
    for processes in ("2", "1"):
        args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port", str(first.port),
                "--processes", processes, "--seed", "6"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (processes, done.stderr)
        assert f"cannot listen on 127.0.0.1:{first.port}" in done.stderr and "in use" in done.stderr, done.stderr
    assert len(read_epoch(first.endpoint, local=False)) == 200  # (the first server still serves, whole)


@pytest.mark.parametrize("count", ["0", "two"])
def test_processes_must_be_a_positive_number(sample_dataset: Path, count: str) -> None:
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--processes", count]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--processes" in done.stderr


def test_more_processes_than_cores_is_warned_of(sample_dataset: Path, tmp_path: Path) -> None:
    import os

    core = min(os.sched_getaffinity(0))
    on_one_core = (f"import os, sys; os.sched_setaffinity(0, {{{core}}}); "
                   "os.execv(sys.executable, [sys.executable, '-m', 'fuelline.server.cli', *sys.argv[1:]])")
    server = ServerProcess([sys.executable, "-c", on_one_core, "serve", str(sample_dataset), "--port", "0",
                            "--processes", "2"], tmp_path / "serve.log")
    try:
        assert "--processes 2 with 1 cores for this server" in server.log(), server.log()
    finally:
        assert server.close()


def test_a_serving_process_that_cannot_publish_its_socket_still_serves(sample_dataset: Path, start_serve,
                                                                      tmp_path: Path) -> None:
    """The folder the processes share may be unwritable (a full /dev/shm): the process serves, and
    offers its clients its own socket."""
    server = start_serve(sample_dataset, *ARGS, "--serving-process", "0", "--serving-group", str(tmp_path / "gone"))
    ids = read_epoch(server.endpoint)
    assert len(ids) == 200 and "cannot tell the other serving processes" in server.log()
