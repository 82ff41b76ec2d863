"""Reading deploy/ as its tools would, and checking its command lines with the project's parsers.

Every command line in deploy/ is taken out of its file by parsing the file, and parsed with the
project's own argument parsers: ``fuelline ...`` goes through ``fuelline.server.cli.build_parser()``,
and ``torchrun ... -m fuelline.trainer ...`` through ``fuelline.trainer.cli.parse_args`` (and
torchrun's own parser where torch is installed). A renamed or removed option then fails a test, not
a deployment. Dockerfiles and compose.yaml are read here too: the Kubernetes checks need the
images' ENTRYPOINT and CMD, and the CURVE checks compose's services.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import pytest

from fuelline.server.cli import build_parser
from fuelline.server.serving.keys import is_loopback
from fuelline.trainer.cli import parse_args as parse_trainer_args

__all__ = [
    "CONTAINER", "DEPLOY", "IMAGES", "KUBERNETES", "ROOT", "SYSTEMD", "Command", "ComposeService", "Dockerfile",
    "_yaml", "check_command", "compose", "compose_services", "exact_option_names", "image_dockerfile",
    "nproc_per_node", "read_dockerfile", "trainer_accepts_curve_keys", "trainer_targets", "under",
]

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/ is two levels down
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
CONTAINER = DEPLOY / "container"
KUBERNETES = DEPLOY / "kubernetes"

# Which Dockerfile builds an image, by the image's name (without registry or tag).
IMAGES = {"fuelline-server": CONTAINER / "Dockerfile.server", "fuelline-trainer": CONTAINER / "Dockerfile.trainer"}

# ---------------------------------------------------------------------------------------------
# Command lines, through the project's own parsers


@dataclass
class Command:
    """A command line from deploy/ and what the parsers made of it."""

    where: str
    argv: list[str]
    fuelline: argparse.Namespace | None = None  # `fuelline ...`
    trainer: argparse.Namespace | None = None  # `torchrun ... -m fuelline.trainer ...`
    torchrun_options: list[str] | None = None
    torchrun: argparse.Namespace | None = None  # torchrun's own parser, where torch is installed

    @property
    def serves(self) -> bool:
        return self.fuelline is not None and self.fuelline.command == "serve"

    def show(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


@contextlib.contextmanager
def exact_option_names() -> Iterator[None]:
    """Parsers made meanwhile refuse abbreviations: argparse would take --server for --servers,
    and a deploy file that abbreviates breaks once another option shares the prefix."""
    init = argparse.ArgumentParser.__init__

    def exact(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "__init__", exact):
        yield


def _parse(parse: Callable[[Sequence[str]], argparse.Namespace], argv: list[str], whole: list[str], where: str,
           what: str) -> argparse.Namespace:
    """``parse(argv)``; argparse's exit becomes a test failure naming the command line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), exact_option_names():
            return parse(argv)
    except SystemExit as exc:
        code = exc.code
    message = err.getvalue().strip().splitlines()
    pytest.fail(
        f"{where}: {what} rejects this command line (exit {code}):\n  {shlex.join(whole)}\n"
        f"{message[-1] if message else ''}",
        pytrace=False,
    )


@functools.lru_cache(maxsize=None)
def _torchrun_parser() -> argparse.ArgumentParser | None:
    try:
        from torch.distributed.run import get_args_parser
    except ImportError:  # a data-server install: torchrun's own options go unchecked
        return None
    with exact_option_names():
        return get_args_parser()


def check_command(argv: Sequence[str], where: str) -> Command:
    """Parse a deploy/ command line with the parser of the program it runs."""
    argv = [str(a) for a in argv]
    if not argv:
        pytest.fail(f"{where}: empty command line", pytrace=False)
    program = PurePosixPath(argv[0]).name
    is_python = re.fullmatch(r"python3?(\.\d+)?", program) is not None
    python_module = argv[2] if is_python and argv[1:2] == ["-m"] and len(argv) > 2 else None
    cmd = Command(where, argv)
    if program == "fuelline" or python_module == "fuelline.server.cli":
        rest = argv[1:] if program == "fuelline" else argv[3:]
        cmd.fuelline = _parse(lambda a: build_parser().parse_args(a), rest, argv, where,
                              "fuelline's parser (build_parser)")
        ns = cmd.fuelline
        if ns.command == "serve" and not is_loopback(ns.host) and not ns.curve_keys and not ns.insecure:
            pytest.fail(f"{where}: serves on {ns.host} without --curve-keys or --insecure, which `fuelline serve` "
                        f"refuses at start-up: {shlex.join(argv)}", pytrace=False)
    elif program == "torchrun" or python_module == "torch.distributed.run":
        options = argv[1:] if program == "torchrun" else argv[3:]
        _check_torchrun(cmd, options)
    elif python_module == "fuelline.trainer":
        cmd.trainer = _parse(parse_trainer_args, argv[3:], argv, where, "fuelline.trainer's parser")
    else:
        pytest.fail(f"{where}: not a fuelline or torchrun command line: {shlex.join(argv)}", pytrace=False)
    return cmd


def _check_torchrun(cmd: Command, options: list[str]) -> None:
    for i, arg in enumerate(options):  # noqa: B007 (i is read after the loop)
        if arg in ("-m", "--module"):
            break
    else:
        pytest.fail(f"{cmd.where}: torchrun without -m fuelline.trainer: {shlex.join(cmd.argv)}", pytrace=False)
    if options[i + 1:i + 2] != ["fuelline.trainer"]:
        pytest.fail(f"{cmd.where}: torchrun runs something else than fuelline.trainer: {shlex.join(cmd.argv)}",
                    pytrace=False)
    cmd.torchrun_options = options[:i]
    trainer_argv = options[i + 2:]
    cmd.trainer = _parse(parse_trainer_args, trainer_argv, cmd.argv, cmd.where, "fuelline.trainer's parser")
    parser = _torchrun_parser()
    if parser is not None:
        ns = _parse(parser.parse_args, options, cmd.argv, cmd.where, "torchrun's parser")
        assert ns.module and ns.training_script == "fuelline.trainer", cmd.show()
        assert list(ns.training_script_args) == trainer_argv, cmd.show()
        cmd.torchrun = ns


def nproc_per_node(cmd: Command) -> str | None:
    """torchrun's --nproc_per_node / --nproc-per-node, from its own options."""
    if cmd.torchrun is not None:
        return str(cmd.torchrun.nproc_per_node)
    options = cmd.torchrun_options or []
    for i, arg in enumerate(options):
        name, eq, value = arg.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            return value if eq else options[i + 1]
    return None


def trainer_targets(cmd: Command) -> list[tuple[str, int]]:
    """The (host, port) of every data server in a trainer's --servers."""
    out = []
    for server in cmd.trainer.servers:
        host, _, port = server.rpartition(":")
        assert host and port.isdigit(), f"--servers must be HOST:PORT[,HOST:PORT...]: {cmd.show()}"
        out.append((host, int(port)))
    return out


def trainer_accepts_curve_keys() -> bool:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_trainer_args(["--servers", "h:1", "--curve-keys", "/keys"])
    except SystemExit:
        return False
    return True


def under(path: str, directory: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(directory) or PurePosixPath(directory) in PurePosixPath(path).parents


# ---------------------------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]

    def all(self, name: str) -> list[str]:
        return [rest for instr, rest in self.instructions if instr == name]

    def last(self, name: str) -> str | None:
        found = self.all(name)
        return found[-1] if found else None

    def exec_form(self, name: str) -> list[str]:
        """ENTRYPOINT or CMD, which must be the exec form: the shell form runs /bin/sh -c, which
        does not pass SIGTERM on, so the server could not tell its clients before it stops."""
        rest = self.last(name)
        if rest is None:
            return []
        try:
            value = json.loads(rest)
        except ValueError:
            value = None
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), (
            f"{self.path.name}: {name} must be the exec form (a JSON array), got {rest}")
        return value

    @property
    def entrypoint(self) -> list[str]:
        return self.exec_form("ENTRYPOINT")

    @property
    def cmd(self) -> list[str]:
        return self.exec_form("CMD")


@functools.lru_cache(maxsize=None)
def read_dockerfile(path: Path) -> Dockerfile:
    instructions = []
    pending = ""
    for raw in path.read_text().splitlines():
        text = raw.strip()
        if not text or text.startswith("#"):  # comments (and parser directives), also inside continuations
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        line, pending = pending + text, ""
        instr, _, rest = line.partition(" ")
        instructions.append((instr.upper(), rest.strip()))
    assert not pending, f"{path.name}: ends inside a continued line"
    return Dockerfile(path, instructions)


def image_dockerfile(image: str, where: str) -> Dockerfile:
    name = image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
    assert name in IMAGES, f"{where}: image {image!r} is none of the images deploy/container builds ({sorted(IMAGES)})"
    return read_dockerfile(IMAGES[name])


# ---------------------------------------------------------------------------------------------
# YAML: compose and Kubernetes


def _yaml():
    return pytest.importorskip("yaml", reason="PyYAML is needed to read compose.yaml and the Kubernetes manifests")


def _interpolate_defaults(text: str) -> str:
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR}, with the variables unset."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?[-?]([^}]*))?\}", lambda m: m.group(1) or "", text)


@functools.lru_cache(maxsize=None)
def compose() -> dict[str, Any]:
    return _yaml().safe_load((CONTAINER / "compose.yaml").read_text())


@dataclass
class ComposeService:
    name: str
    spec: dict[str, Any]
    command: Command

    def mounts(self) -> dict[str, bool]:
        """Target path -> read-only, from the long or the short syntax."""
        found = {}
        for volume in self.spec.get("volumes", []):
            if isinstance(volume, dict):
                found[volume["target"]] = bool(volume.get("read_only", False))
            else:
                parts = _interpolate_defaults(volume).split(":")
                found[parts[1]] = len(parts) > 2 and "ro" in parts[2].split(",")
        return found


@functools.lru_cache(maxsize=None)
def compose_services() -> dict[str, ComposeService]:
    services = {}
    for name, spec in compose()["services"].items():
        where = f"compose.yaml service {name}"
        assert spec.get("image"), f"{where}: no image"
        image = image_dockerfile(spec["image"], where)
        if "build" in spec:
            build = spec["build"]
            context = (CONTAINER / build["context"]).resolve()
            built = (context / build["dockerfile"]).resolve()
            assert built.is_file(), f"{where}: build.dockerfile {built} does not exist"
            assert built == image.path.resolve(), f"{where}: builds {built.name} but is named {spec['image']}"
        # Docker's rules: entrypoint replaces the image's and drops its CMD; command replaces CMD.
        for key in ("entrypoint", "command"):
            assert not isinstance(spec.get(key), str), f"{where}: give {key} as a list, as exec form"
        entrypoint = spec.get("entrypoint", image.entrypoint)
        command = spec.get("command", [] if "entrypoint" in spec else image.cmd)
        services[name] = ComposeService(name, spec, check_command([*entrypoint, *command], where))
    return services
