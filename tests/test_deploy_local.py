"""deploy/local: ``demo.sh`` leaves nothing in the temporary folder, whether it ends or is
interrupted (unless asked to keep it), and ``setup-venv.sh`` installs torch's CPU build as the
README's Install says."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "deploy" / "local" / "demo.sh"
DEMO_TIMEOUT_S = 300  # (about 10 s of work; the first run may also install the data-server kind)


def _demo(tmp: Path, **env: str) -> subprocess.Popen[str]:
    """The demo with ``tmp`` as its temporary folder, in a process group of its own (what a
    terminal's Ctrl-C signals)."""
    return subprocess.Popen(["bash", str(DEMO)], env={**os.environ, "TMPDIR": str(tmp), **env}, cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    out: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)
        out.put(None)

    threading.Thread(target=read, daemon=True).start()
    return out


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder


def test_the_demo_leaves_nothing_in_the_temporary_folder(tmp: Path) -> None:
    proc = _demo(tmp)
    try:
        out, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "server exited with 0" in out
    assert list(tmp.iterdir()) == []


def test_the_demo_interrupted_leaves_nothing_in_the_temporary_folder(tmp: Path) -> None:
    proc = _demo(tmp)
    lines = _lines(proc)
    seen = []
    try:
        while True:  # until the server serves: the demo's largest state, and a process to stop
            line = lines.get(timeout=DEMO_TIMEOUT_S)
            assert line is not None, "".join(seen)[-4000:]
            seen.append(line)
            if line.startswith("serving on"):
                break
        assert any(tmp.iterdir())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert list(tmp.iterdir()) == []


def test_the_demo_keeps_its_folder_when_asked(tmp: Path) -> None:
    proc = _demo(tmp, FUELLINE_DEMO_KEEP="1")
    try:
        out, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    kept = Path(re.findall(r"^kept (\S+)$", out, re.M)[-1])
    assert kept.parent == tmp and (kept / "data" / "manifest.json").is_file()


def test_setup_venv_installs_torch_from_the_cpu_index_the_readme_names() -> None:
    readme = (ROOT / "README.md").read_text()
    version, index = re.search(r"^pip install torch==(\S+) --index-url (\S+)$", readme, re.M).groups()
    script = (ROOT / "deploy" / "local" / "setup-venv.sh").read_text()
    assert f'TORCH_CPU_INDEX="{index}"' in script
    (install,) = [line for line in script.splitlines() if "pip_quiet" in line and "torch==" in line]
    assert f'"torch=={version}"' in install and '--extra-index-url "$TORCH_CPU_INDEX"' in install, install
