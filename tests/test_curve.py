"""CURVE: keygen, an authorized client streams, everyone else is refused with a clear error.

Servers are real ``fuelline serve`` processes on ephemeral loopback ports; those bound to
0.0.0.0 only have their log read, and no traffic is sent to them.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from fuelline.client import ServerDataStream
from fuelline.client.curve import CURVE_MISMATCH, CURVE_REFUSED, CurveKeys
from fuelline.protocol import DataError, RemoteError, ServerUnavailable
from fuelline.server import ParquetSource, Server
from fuelline.server.cli import main
from fuelline.server.serving.keys import CurveConfig, is_loopback, keygen

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

TRAIN_ROWS = 8000


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A server's keys with one authorized client, that client's keys, and a stranger's keys."""
    server, client, stranger = (tmp_path / name for name in ("server-keys", "client-keys", "stranger-keys"))
    keygen(server)
    (server / "authorized").mkdir()
    for where in (client, stranger):
        keygen(where, "client")
        shutil.copy(server / "server.key", where / "server.key")
    shutil.copy(client / "client.key", server / "authorized" / "alice.key")
    return {"server": server, "client": client, "stranger": stranger}


def read_epoch(stream: ServerDataStream) -> int:
    return sum(len(batch["features"]) for batch in stream.get_epoch_iterator(as_dict=True))


def test_keygen_writes_a_private_pair_and_never_overwrites(tmp_path: Path, capsys) -> None:
    out = tmp_path / "keys"
    assert main(["keygen", str(out), "--name", "client"]) == 0
    public, secret = out / "client.key", out / "client.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not list(out.glob(".keygen-*"))  # the scratch folder is gone
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None) and sec is not None
    assert zmq.curve_public(sec) == pub
    before = secret.read_bytes()
    capsys.readouterr()
    assert main(["keygen", str(out), "--name", "client"]) == 2
    assert "client.key exists; keygen never overwrites" in capsys.readouterr().err
    assert secret.read_bytes() == before


def test_authorized_client_streams_an_encrypted_epoch(sample_dataset: Path, start_serve, keys) -> None:
    server = start_serve(sample_dataset, "--curve-keys", str(keys["server"]), "--batch-size", "500")
    with ServerDataStream(endpoints=[server.endpoint], curve_keys=keys["client"], timeout=10.0) as stream:
        assert read_epoch(stream) == TRAIN_ROWS
        sock = stream._conns[0]._sock  # noqa: SLF001 (the only way to see the mechanism in use)
        assert sock.get(zmq.MECHANISM) == zmq.CURVE
    log = server.log()
    assert "CURVE: 1 authorized client keys" in log and "without encryption" not in log


def test_plain_client_is_told_the_server_requires_curve(sample_dataset: Path, start_serve, keys) -> None:
    server = start_serve(sample_dataset, "--curve-keys", str(keys["server"]))
    started = time.monotonic()
    with ServerDataStream(endpoints=[server.endpoint], timeout=5.0, heartbeat=0.2) as stream:
        with pytest.raises(RemoteError) as info:
            read_epoch(stream)
    assert time.monotonic() - started < 5.0  # at once, not after the timeout
    assert info.value.code == CURVE_MISMATCH
    assert "requires CURVE authentication" in str(info.value) and server.endpoint in str(info.value)


def test_client_with_an_unauthorized_key_is_refused(sample_dataset: Path, start_serve, keys) -> None:
    server = start_serve(sample_dataset, "--curve-keys", str(keys["server"]))
    started = time.monotonic()
    with ServerDataStream(endpoints=[server.endpoint], curve_keys=keys["stranger"], timeout=5.0) as stream:
        with pytest.raises(RemoteError) as info:
            read_epoch(stream)
    assert time.monotonic() - started < 5.0
    assert info.value.code == CURVE_REFUSED
    # The client names its key file and the public certificate the server needs; the key comes last.
    stranger = zmq.auth.load_certificate(keys["stranger"] / "client.key")[0].decode()
    message = str(info.value)
    assert f"refused this client's CURVE key from {keys['stranger'] / 'client.key_secret'}: " in message, message
    assert f"copy its public certificate {keys['stranger'] / 'client.key'} into the server's authorized/" in message
    assert message.index(str(keys["stranger"])) < message.index(stranger)
    # The server names the key file it holds (the key is in none), then the key.
    authorized = keys["server"] / "authorized"
    log = server.wait_log(r"refused a client: ", timeout=5.0)
    (line,) = [x for x in log.splitlines() if "refused a client: " in x]
    assert f"its CURVE key is not the one in {authorized / 'alice.key'}; " in line, line
    assert line.index("alice.key") < line.index(stranger), line


def test_a_refusal_names_the_key_file_added_after_the_server_started(sample_dataset: Path, start_serve, keys) -> None:
    server = start_serve(sample_dataset, "--curve-keys", str(keys["server"]))
    added = keys["server"] / "authorized" / "bob.key"
    shutil.copy(keys["stranger"] / "client.key", added)  # (read at start-up only)
    with ServerDataStream(endpoints=[server.endpoint], curve_keys=keys["stranger"], timeout=5.0) as stream:
        with pytest.raises(RemoteError) as info:
            read_epoch(stream)
    assert info.value.code == CURVE_REFUSED
    log = server.wait_log(r"refused a client: ", timeout=5.0)
    (line,) = [x for x in log.splitlines() if "refused a client: " in x]
    assert f"its CURVE key is in {added}, added after this server read" in line, line
    assert "restart the server to accept that client" in line, line


def test_a_client_refused_with_keys_not_read_from_a_file_is_told_so(sample_dataset: Path, start_serve, keys) -> None:
    server = start_serve(sample_dataset, "--curve-keys", str(keys["server"]))
    read = CurveKeys.from_dir(keys["stranger"])
    held = CurveKeys(read.public_key, read.secret_key, read.server_key)  # (from a secret store, say)
    with ServerDataStream(endpoints=[server.endpoint], curve_keys=held, timeout=5.0) as stream:
        with pytest.raises(RemoteError) as info:
            read_epoch(stream)
    assert info.value.code == CURVE_REFUSED
    assert "not read from a key file" in str(info.value) and read.public_key.decode() in str(info.value)


def test_client_with_the_wrong_server_key_gives_up_naming_curve(sample_dataset: Path, start_serve, keys) -> None:
    # The server cannot open the client's hello, so the client sees only failed handshakes.
    server = start_serve(sample_dataset, "--curve-keys", str(keys["server"]))
    mine = CurveKeys.from_dir(keys["client"])
    wrong = CurveKeys(mine.public_key, mine.secret_key, server_key=zmq.curve_keypair()[0])
    started = time.monotonic()
    with ServerDataStream(endpoints=[server.endpoint], curve_keys=wrong, timeout=1.5, heartbeat=0.2) as stream:
        with pytest.raises(ServerUnavailable) as info:
            read_epoch(stream)
    assert 1.5 <= time.monotonic() - started < 5.0
    message = str(info.value)
    assert "handshake failed" in message and "may not be this client's server.key" in message


def test_curve_client_of_a_plain_server_is_told(sample_dataset: Path, start_serve, keys) -> None:
    server = start_serve(sample_dataset)
    with ServerDataStream(endpoints=[server.endpoint], curve_keys=keys["client"], timeout=1.5, heartbeat=0.2) as stream:
        # Which side notices the mismatch first is a race: at once, or failed handshakes until the timeout.
        with pytest.raises((RemoteError, ServerUnavailable)) as info:
            read_epoch(stream)
    assert "the server does not" in str(info.value) or "the server may not use CURVE" in str(info.value)


def test_missing_key_files_are_named(sample_dataset: Path, tmp_path: Path, keys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"client\.key_secret does not exist"):
        ServerDataStream(port=1, curve_keys=empty)
    os.remove(keys["client"] / "server.key")
    with pytest.raises(DataError, match=r"client-keys/server\.key does not exist"):
        ServerDataStream(port=1, curve_keys=keys["client"])
    (keys["server"] / "authorized" / "bad.key").write_text("curve\n")
    with pytest.raises(DataError, match=r"bad\.key: No public key"):
        CurveConfig.from_dir(keys["server"])
    shutil.rmtree(keys["server"] / "authorized")
    with pytest.raises(DataError, match=r"no directory .*authorized"):
        CurveConfig.from_dir(keys["server"])
    run = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--port", "0", "--curve-keys", str(empty)],
        capture_output=True, text=True, timeout=30,
    )
    assert run.returncode == 2
    assert f"fuelline serve: error: CURVE key file {empty / 'server.key_secret'} does not exist" in run.stderr


def test_in_process_server_stops_its_authenticator(sample_dataset: Path, keys) -> None:
    source = ParquetSource(str(sample_dataset), batch_size=1000)
    server = Server(source, port=0, curve=CurveConfig.from_dir(keys["server"]))
    server.start()
    try:
        host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
        with ServerDataStream(host=host, port=int(port), curve_keys=keys["client"], timeout=10.0) as stream:
            assert stream.batches_per_epoch == TRAIN_ROWS // 1000
    finally:
        server.stop()
        server.join(10)
    assert not server._thread.is_alive()  # noqa: SLF001 (the context terminated: nothing held it)
    assert not any(type(t).__name__ == "AuthenticationThread" for t in threading.enumerate())


def test_off_loopback_without_curve_is_refused_unless_insecure(sample_dataset: Path, start_serve, keys) -> None:
    # Refused before it opens the dataset or binds: nothing listens, and the message says what to do.
    refused = subprocess.run(
        [sys.executable, "-m", "fuelline.server.cli", "serve", str(sample_dataset), "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert "serving on" not in refused.stdout
    assert "--host 0.0.0.0 without --curve-keys" in refused.stderr
    assert "fuelline keygen" in refused.stderr and "--insecure" in refused.stderr
    # The operator may insist, and is warned; with CURVE there is nothing to warn about.
    plain = start_serve(sample_dataset, "--host", "0.0.0.0", "--insecure")
    plain.wait_log(r"serving on 0\.0\.0\.0 without encryption or authentication \(insecure\)", timeout=5.0)
    assert plain.terminate() == 0
    secured = start_serve(sample_dataset, "--host", "0.0.0.0", "--curve-keys", str(keys["server"]))
    assert secured.terminate() == 0
    assert "without encryption" not in secured.log()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_library_refuses_an_open_bind_without_insecure(sample_dataset: Path, host: str) -> None:
    source = ParquetSource(str(sample_dataset), batch_size=1000)
    try:
        with pytest.raises(DataError, match=r"without CURVE.*fuelline keygen.*insecure=True"):
            Server(source, host=host, port=0)
        server = Server(source, host=host, port=0, insecure=True, local_ipc=False)
        server.start()  # (binds; no traffic is sent to it)
        server.stop()
        server.join(10)
        assert not server._thread.is_alive()  # noqa: SLF001
    finally:
        source.close()


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
     ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("*", False),
     ("example.org", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_curve_keys_validate_and_hide_the_secret(keys) -> None:
    loaded = CurveKeys.from_dir(keys["client"])
    assert loaded.secret_key.decode() not in repr(loaded)
    with pytest.raises(ValueError, match="40 bytes of Z85"):
        CurveKeys(loaded.public_key, b"short", loaded.server_key)
