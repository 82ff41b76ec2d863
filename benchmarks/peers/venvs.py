"""The virtual environments the peers run in, one per peer under ``benchmarks/.venvs/<peer>/``,
built on demand with ``python -m venv`` and pinned versions.

The peers' dependencies clash with one another and with fuelline's (numpy, pyarrow and protobuf
ranges), so none is installed beside fuelline: each peer's reader runs as a child process in its
own environment. torch is always the CPU build that lies on this machine's disk (``torch==2.13.0``
resolves to it), never a plain ``torch`` that would pull several GB of CUDA wheels.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VENVS_DIR", "PeerEnv", "ENVS", "ensure"]

VENVS_DIR = Path(__file__).resolve().parents[1] / ".venvs"
TORCH = ("torch==2.13.0", "torchvision==0.28.0")
INSTALL_TIMEOUT_S = 1800


@dataclass(frozen=True)
class PeerEnv:
    """A peer's environment: its name (the folder) and the pinned requirements it is built from."""

    name: str
    requirements: tuple[str, ...]

    @property
    def path(self) -> Path:
        return VENVS_DIR / self.name

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def marker(self) -> Path:
        """Written last, with the requirements and what pip installed: a folder without it (an
        interrupted build) or with other requirements is built again."""
        return self.path / "peer-env.json"


ENVS = {
    "mosaic": PeerEnv("mosaic", (*TORCH, "mosaicml-streaming==0.13.0", "pyarrow==26.0.1")),
    "litdata": PeerEnv("litdata", (*TORCH, "litdata==0.2.76", "pyarrow==26.0.1")),
    "ray": PeerEnv("ray", ("torch==2.13.0", "ray[data,train]==2.58.0", "pyarrow==26.0.1",
                        "aiohttp==3.14.5")),
    "tfdata": PeerEnv("tfdata", ("tensorflow-cpu==2.21.0", "pyarrow==26.0.1")),
}


def ready(env: PeerEnv) -> bool:
    try:
        meta = json.loads(env.marker.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("requirements") == list(env.requirements) and env.python.exists()


def versions(env: PeerEnv) -> dict[str, str]:
    """What pip installed there, by distribution name (from the marker)."""
    try:
        return dict(json.loads(env.marker.read_text()).get("installed", {}))
    except (OSError, ValueError):
        return {}


def ensure(env: PeerEnv, log: Path) -> None:
    """Build ``env`` unless it is already built from the same requirements; raises
    ``RuntimeError`` with the tail of pip's output when it cannot be built."""
    if ready(env):
        return
    if env.path.exists():
        shutil.rmtree(env.path)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        steps = [[sys.executable, "-m", "venv", str(env.path)],
                 # torch first and alone, so that nothing after it can bring another build of it
                 *([[str(env.python), "-m", "pip", "install", "--no-input", "torch==2.13.0"]]
                   if any(r.startswith("torch==") for r in env.requirements) else []),
                 [str(env.python), "-m", "pip", "install", "--no-input", *env.requirements]]
        for argv in steps:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            try:
                done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"{env.name}: `{' '.join(argv[2:])}` took over {INSTALL_TIMEOUT_S}s") from exc
            if done.returncode:
                tail = log.read_text(errors="replace").splitlines()[-6:]
                raise RuntimeError(f"{env.name}: `{' '.join(argv[2:])}` exited {done.returncode}: " + " / ".join(tail))
    freeze = subprocess.run([str(env.python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            timeout=120)
    installed = {p["name"]: p["version"] for p in json.loads(freeze.stdout or "[]")}
    env.marker.write_text(json.dumps({"requirements": list(env.requirements), "installed": installed,
                                      "build_s": round(time.perf_counter() - started, 1)}, indent=2) + "\n")


if __name__ == "__main__":
    for name in sys.argv[1:] or list(ENVS):
        t0 = time.perf_counter()
        try:
            ensure(ENVS[name], VENVS_DIR / f"{name}.log")
            print(f"{name}: ready ({time.perf_counter() - t0:.0f}s)", flush=True)
        except RuntimeError as exc:
            print(f"{name}: FAILED: {exc}", flush=True)
