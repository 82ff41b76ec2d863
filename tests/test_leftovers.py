"""What a server killed with -9 leaves behind is swept by the next server that starts, and only that.

A live server holds a lock on its Unix socket folder; the kernel drops it when the process dies,
however it dies, so a pid that the next server (a container restarted after kill -9) gets again
does not fool the sweep.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from fuelline.client import ServerDataStream
from fuelline.server.serving.local_ipc import LocalSocketDir, sweep_stale_dirs

from support.processes import ServerProcess

TIMEOUT = 20.0


def _serve(dataset: Path, tmp: Path, name: str) -> ServerProcess:
    env = {**os.environ, "TMPDIR": str(tmp)}  # the sweep looks in the temporary directory: this test's own
    args = [sys.executable, "-m", "fuelline.server.cli", "serve", str(dataset), "--port", "0", "--batch-size", "500"]
    return ServerProcess(args, tmp.parent / f"{name}.log", env=env)


def _socket_dir(server: ServerProcess) -> Path:
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=TIMEOUT) as stream:
        next(iter(stream.get_epoch_iterator()))
        (transport,) = stream.transports
    assert transport.startswith("ipc://"), transport
    return Path(transport[len("ipc://"):]).parent


def test_a_server_killed_with_sigkill_leaves_a_folder_the_next_start_removes(sample_dataset: Path, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    started = []
    try:
        started.append(dead := _serve(sample_dataset, tmp, "dead"))
        started.append(live := _serve(sample_dataset, tmp, "live"))
        dead_dir, live_dir = _socket_dir(dead), _socket_dir(live)
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait(10)
        assert dead_dir.exists()  # kill -9: nobody could remove it
        started.append(fresh := _serve(sample_dataset, tmp, "fresh"))
        assert not dead_dir.exists(), "the dead server's folder was not swept"
        assert live_dir.exists(), "a live server's folder was swept"
        assert _socket_dir(live) == live_dir  # and its local clients still reach it there
        fresh_dir = _socket_dir(fresh)
        for server in (live, fresh):
            assert server.terminate() == 0
        assert not live_dir.exists() and not fresh_dir.exists()  # a clean stop removes its own
        assert sorted(os.listdir(tmp)) == []
    finally:
        for server in started:
            server.close()


def test_the_sweep_judges_folders_by_their_lock_or_their_socket(tmp_path: Path) -> None:
    live = LocalSocketDir(str(tmp_path))
    Path(live.socket_path + ".token").write_text("t")
    dead = LocalSocketDir(str(tmp_path))
    Path(dead.socket_path + ".token").write_text("t")
    os.close(dead._lock_fd)  # noqa: SLF001 (what the kernel does when its server dies)
    dead._lock_fd = None  # noqa: SLF001
    # Folders of servers from before the lock: a refused connection on the socket means nobody is there.
    old_dead = tmp_path / "fuelline-olddead"
    old_dead.mkdir()
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(old_dead / "server.sock"))
    bound.close()  # the socket file stays, nobody listens
    old_live = tmp_path / "fuelline-oldlive"
    old_live.mkdir()
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(old_live / "server.sock"))
    listening.listen(1)
    other = tmp_path / "fuelline-notaserver"  # a folder with our prefix that is not a server's
    other.mkdir()
    try:
        removed = sweep_stale_dirs(str(tmp_path))
        assert sorted(removed) == sorted([dead.path, str(old_dead)])
        assert Path(live.path).exists() and old_live.exists() and other.exists()
    finally:
        listening.close()
        live.remove()
