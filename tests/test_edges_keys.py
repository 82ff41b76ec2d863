"""A secret CURVE key where a public one belongs is refused, naming the file and the file to copy
instead: a client's ``.key_secret`` in the server's ``authorized/`` (under any name), and a
``.key_secret`` given to a client as the server's ``server.key``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from fuelline.client import ServerDataStream
from fuelline.client.curve import CurveKeys
from fuelline.protocol import DataError
from fuelline.server.serving.keys import CurveConfig, keygen

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

CLI = [sys.executable, "-m", "fuelline.server.cli"]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A server's keys with an empty authorized/, and a client's keys with the server's public key."""
    server, client = tmp_path / "server-keys", tmp_path / "client-keys"
    keygen(server)
    (server / "authorized").mkdir()
    keygen(client, "client")
    shutil.copy(server / "server.key", client / "server.key")
    return {"server": server, "client": client}


def assert_refuses_secret(message: str, path: Path, copy: str) -> None:
    assert str(path) in message, message
    assert "holds a secret key" in message and "must never leave its owner" in message, message
    assert copy in message, message


# A client's secret key file copied into authorized/: as it is named, renamed to look public, or
# under a name that is not a key's at all (the server used to read only *.key files).
@pytest.mark.parametrize("name", ["alice.key_secret", "alice.key", "alice", ".alice.key_secret"])
def test_a_secret_key_in_authorized_is_refused_whatever_its_name(keys, name: str) -> None:
    placed = keys["server"] / "authorized" / name
    shutil.copy(keys["client"] / "client.key_secret", placed)
    with pytest.raises(DataError) as info:
        CurveConfig.from_dir(keys["server"])
    assert_refuses_secret(str(info.value), placed, "copy the client's public NAME.key (never NAME.key_secret)")


def test_public_keys_and_other_files_in_authorized_are_still_accepted(keys) -> None:
    shutil.copy(keys["client"] / "client.key", keys["server"] / "authorized" / "alice.key")
    (keys["server"] / "authorized" / "README").write_text("one public .key file per client\n")
    accepted = CurveConfig.from_dir(keys["server"]).client_keys()
    assert list(accepted.values()) == [str(keys["server"] / "authorized" / "alice.key")]


def test_serve_refuses_a_secret_key_in_authorized_in_one_line(keys, sample_dataset: Path) -> None:
    placed = keys["server"] / "authorized" / "alice.key"
    shutil.copy(keys["client"] / "client.key_secret", placed)
    out = subprocess.run([*CLI, "serve", str(sample_dataset), "--port", "0", "--curve-keys", str(keys["server"])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("fuelline serve: error:"), out.stderr
    assert_refuses_secret(last, placed, "NAME.key")


def test_a_client_given_the_servers_secret_key_as_server_key_refuses_it(keys) -> None:
    shared = keys["client"] / "server.key"
    shutil.copy(keys["server"] / "server.key_secret", shared)
    with pytest.raises(DataError) as info:
        CurveKeys.from_dir(keys["client"])
    assert_refuses_secret(str(info.value), shared, "copy the server's public server.key here instead")
    with pytest.raises(DataError, match="holds a secret key"):
        ServerDataStream(port=5557, curve_keys=keys["client"], timeout=1.0)


def test_a_client_given_its_own_secret_key_as_server_key_is_told_so(keys) -> None:
    shared = keys["client"] / "server.key"
    shutil.copy(keys["client"] / "client.key_secret", shared)
    with pytest.raises(DataError) as info:
        CurveKeys.from_dir(keys["client"])
    message = str(info.value)
    assert_refuses_secret(message, shared, "copy the server's public server.key here instead")
    assert "this client's own client.key_secret" in message, message


def test_stream_refuses_a_secret_server_key_in_one_line(keys) -> None:
    shared = keys["client"] / "server.key"
    shutil.copy(keys["server"] / "server.key_secret", shared)
    out = subprocess.run([*CLI, "stream", "127.0.0.1:5557", "--curve-keys", str(keys["client"]), "--timeout", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert_refuses_secret(out.stderr.strip().splitlines()[-1], shared, "server.key")


def test_a_server_whose_shared_server_key_holds_its_secret_is_refused(keys) -> None:
    # Clients copy KEYS/server.key: one that holds the secret would hand it to every one of them.
    shared = keys["server"] / "server.key"
    shutil.copy(keys["server"] / "server.key_secret", shared)
    with pytest.raises(DataError) as info:
        CurveConfig.from_dir(keys["server"])
    assert_refuses_secret(str(info.value), shared, "clients copy this file")
