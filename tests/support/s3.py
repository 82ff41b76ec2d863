"""A real S3-protocol server (moto) on a loopback port, for the remote-storage tests.

``s3_server`` (session-wide) starts ``python -m moto.server`` as a subprocess on an ephemeral
port, waits until it answers over HTTP, and kills it at the end. ``s3`` (per test) puts the
credentials and endpoint into the environment (so server processes started by the test inherit
them) and gives a fresh bucket. Import both into a test module:
``from support.s3 import s3, s3_server  # noqa: F401`` (tests/ is on the path, as for conftest).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow.fs as pafs
import pytest

READY_DEADLINE = 30.0
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "fuelline-test",
    "AWS_SECRET_ACCESS_KEY": "fuelline-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never look for an instance role
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto server."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(
            access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region=CREDENTIALS["AWS_DEFAULT_REGION"], scheme="http", endpoint_override=self.endpoint,
            allow_bucket_creation=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def requests(self, method: str, key_part: str) -> int:
        """How many ``METHOD …key_part…`` requests moto logged (e.g. GETs of one object)."""
        return sum(1 for line in self.log().splitlines() if f'"{method} ' in line and key_part in line)


def _ready(port: int) -> bool:
    """Whether moto answers HTTP at all (an error status is an answer: with authentication
    enforced, an unsigned request fails)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def start_moto(log_path: Path, env: dict[str, str] | None = None) -> S3Server:
    """Start moto on a free loopback port; a port taken meanwhile by someone else is retried.
    ``env``: more of moto's settings (``INITIAL_NO_AUTH_ACTION_COUNT=0`` enforces credentials)."""
    for _ in range(3):
        port = _free_port()
        log = open(log_path, "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS, **(env or {})},
        )
        log.close()
        deadline = time.monotonic() + READY_DEADLINE
        while time.monotonic() < deadline and proc.poll() is None:
            if _ready(port):
                return S3Server(proc, port, log_path)
            time.sleep(0.05)  # polling a server that is starting up; the deadline bounds it
        proc.kill()
        proc.wait(10)
    raise RuntimeError(f"moto did not start within {READY_DEADLINE}s: {log_path.read_text(errors='replace')}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.proc.kill()
        server.proc.wait(10)


@dataclass
class S3Bucket:
    """A fresh bucket on the test's moto server, with the environment set to reach it."""

    server: S3Server
    name: str
    fs: pafs.S3FileSystem

    def uri(self, prefix: str, *, query: bool = False) -> str:
        """``s3://bucket/prefix``; ``query`` puts the endpoint in the URI instead of relying on
        AWS_ENDPOINT_URL from the environment."""
        base = f"s3://{self.name}/{prefix}".rstrip("/")
        return base + (f"?endpoint_override={self.server.endpoint}&scheme=http" if query else "")

    def upload(self, local: Path | str, prefix: str) -> str:
        """Copy a local file or folder to ``prefix``; returns its URI."""
        pafs.copy_files(str(local), f"{self.name}/{prefix}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)
        return self.uri(prefix)

    def put(self, key: str, data: bytes) -> None:
        with self.fs.open_output_stream(f"{self.name}/{key}") as f:
            f.write(data)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_server.endpoint}")
    fs = s3_server.filesystem()
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs.create_dir(name)
    return S3Bucket(s3_server, name, fs)
