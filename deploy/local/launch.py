"""K data servers and a torchrun job of N ranks on this machine, over loopback, on synthetic data.

    bash deploy/local/launch.sh --servers 2 --ranks 2 --epochs 2 [-- TRAINER OPTIONS...]

It synthesises AMIGOS-like recordings and converts them (once per work directory), starts K
``fuelline serve`` processes on free ports, runs ``torchrun --standalone --nproc_per_node N -m
fuelline.trainer --servers <all K>``, passes on its one-line summary of each epoch, and tears
everything down: when the job ends, when it fails, and on Ctrl-C or SIGTERM. Every child runs in
a process group of its own, so the teardown reaches torchrun's ranks too; what ignores SIGTERM for
10 s is killed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Sequence

from fuelline.protocol.common.endpoints import parse_ready_line

READY_S = 120.0
STOP_S = 10.0


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="deploy/local/launch.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--servers", type=int, default=2, help="data servers to start (K)")
    p.add_argument("--ranks", type=int, default=2, help="torchrun ranks (N)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--recordings", type=int, default=24, help="synthetic recordings")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each recording")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=0, help="worker processes per data server")
    p.add_argument("--workdir", type=Path, default=None, help="where data, logs and metrics go (default: a temp dir)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    args = p.parse_args(argv)
    for name in ("servers", "ranks", "epochs", "recordings", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args, extra


class Child:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, stdout: int | IO | None = None) -> None:
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=stdout if stdout is not None else self.log, stderr=self.log,
                                     start_new_session=True, text=True)
        print(f"started {name} (pid {self.proc.pid}, process group {self.proc.pid}; log {log_path})", flush=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 30) -> str:
        """The log's last lines, after the lines that name an error (a rank's own error comes
        before torchrun's long report of it)."""
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in text if re.search(r"error:|Error\b|Exception\b", line)][:10]
        shown = errors + (["  ..."] if errors else []) + text[-lines:]
        return "\n".join(f"  | {line}" for line in shown)


def stop_all(children: list[Child]) -> None:
    """SIGTERM every group, wait, then SIGKILL what is left; reap everything."""
    for child in reversed(children):  # the trainer first, then the servers it reads
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for child in children:
        while child.group_alive() and time.monotonic() < deadline:
            if child.proc.poll() is None:
                try:
                    child.proc.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.05)  # the leader is gone; its group's other members are exiting
    for child in children:
        if child.group_alive():
            print(f"{child.name} did not stop within {STOP_S:.0f}s of SIGTERM: killing it", flush=True)
            child.signal_group(signal.SIGKILL)
        try:
            child.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pass
        child.log.close()
    print("stopped: " + ", ".join(f"{c.name} (exit {c.proc.returncode})" for c in children), flush=True)


def wait_serving(server: Child, out_path: Path) -> str:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        for line in (out_path.read_text() if out_path.exists() else "").splitlines():
            ready = parse_ready_line(line)
            if ready is not None:
                host, port = ready
                return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if not server.alive():
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before serving:\n{server.tail()}")
        time.sleep(0.1)  # polling the readiness line; the deadline bounds it
    raise RuntimeError(f"{server.name} printed no 'serving on' line within {READY_S:.0f}s:\n{server.tail()}")


def prepare_data(work: Path, args: argparse.Namespace) -> Path:
    data = work / f"data-{args.recordings}rec-{args.seconds:g}s"
    if data.is_dir():  # convert writes atomically: a folder that exists is complete
        return data
    raw = work / "raw"
    fuelline = [sys.executable, "-m", "fuelline.server.cli"]
    subprocess.run([*fuelline, "synth", str(raw), "--recordings", str(args.recordings), "--seconds", str(args.seconds),
                    "--seed", "0"], check=True)
    subprocess.run([*fuelline, "convert", str(raw), str(data)], check=True)
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args, trainer_options = parse_args(argv)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fuelline-local-"))
    work.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    try:
        data = prepare_data(work, args)
        endpoints = []
        for k in range(args.servers):
            out = work / f"server-{k}.out"
            server = Child(f"server {k}", [sys.executable, "-m", "fuelline.server.cli", "serve", str(data), "--port", "0",
                                          "--batch-size", str(args.batch_size), "--workers", str(args.workers)],
                           work / f"server-{k}.log", stdout=open(out, "w"))
            children.append(server)
            endpoints.append(wait_serving(server, out))
        print(f"data servers: {', '.join(endpoints)}", flush=True)
        metrics = work / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        trainer = Child("trainer", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    str(args.ranks), "-m", "fuelline.trainer", "--servers", ",".join(endpoints),
                                    "--epochs", str(args.epochs), "--metrics-json", str(metrics), *trainer_options],
                        work / "trainer.log", stdout=subprocess.PIPE)
        children.append(trainer)
        print(f"training: {args.ranks} ranks, {args.epochs} epochs", flush=True)
        assert trainer.proc.stdout is not None
        for line in trainer.proc.stdout:  # the trainer's one-line summary per epoch; the full records are in metrics
            if line.startswith("epoch "):
                print(line, end="", flush=True)
        code = trainer.proc.wait()
        if code != 0:
            print(f"the trainer failed with exit status {code}:\n{trainer.tail()}", file=sys.stderr, flush=True)
            return 1
        print(f"done; metrics in {metrics}", flush=True)
        return 0
    except Interrupted as exc:
        print(f"interrupted ({exc}); stopping everything", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the teardown itself is not interrupted
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(children)


if __name__ == "__main__":
    sys.exit(main())
