"""deploy/ stays true to the code, without Docker, systemd or a cluster.

Every command line in deploy/ is taken out of its file by parsing the file, and parsed with the
project's own argument parsers: the systemd unit's ExecStart with the example environment file's
values, the Dockerfiles' ENTRYPOINT and CMD, compose's command and entrypoint, and the Kubernetes
containers' command and args (on top of the image's ENTRYPOINT where only args are given).
``fuelline ...`` goes through ``fuelline.server.cli.build_parser()``, and ``torchrun ... -m
fuelline.trainer ...`` through ``fuelline.trainer.cli.parse_args`` (and torchrun's own parser where
torch is installed). A renamed or removed option then fails this test, not a deployment.

The rest checks that the pieces fit: mounts, ports, probes, health checks, restart policies,
users, and which server each trainer reads.
"""

from __future__ import annotations

import argparse
import configparser
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

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
CONTAINER = DEPLOY / "container"
KUBERNETES = DEPLOY / "kubernetes"

UNIT = SYSTEMD / "fuelline-serve@.service"
ENV_EXAMPLE = SYSTEMD / "fuelline-serve.env.example"
INSTANCE = "amigos"  # %i when the unit's specifiers are expanded

# Which Dockerfile builds an image, by the image's name (without registry or tag).
IMAGES = {"fuelline-server": CONTAINER / "Dockerfile.server", "fuelline-trainer": CONTAINER / "Dockerfile.trainer"}

# Manifests that kustomization.yaml leaves out on purpose, and why.
APPLIED_ALONE = {"trainer-pytorchjob.yaml": "needs the Kubeflow training operator's CRD"}

# What the Kubeflow training operator puts into a PyTorchJob's containers, for $(VAR) in args.
PYTORCHJOB_ENV = {
    "MASTER_ADDR": "fuelline-train-multinode-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "4",
    "RANK": "0",
    "PET_NNODES": "2",
    "PET_NODE_RANK": "0",
    "PET_NPROC_PER_NODE": "2",
}

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


def test_bad_command_lines_fail_with_the_command_line_in_the_message():
    # The checker itself: a renamed option must fail, naming the command line.
    with pytest.raises(pytest.fail.Exception, match=r"--no-such-option"):
        check_command(["fuelline", "serve", "/data", "--no-such-option"], "example")
    with pytest.raises(pytest.fail.Exception, match=r"fuelline\.trainer's parser"):
        check_command(["torchrun", "--nproc_per_node", "2", "-m", "fuelline.trainer", "--epochs", "3"], "example")
    with pytest.raises(pytest.fail.Exception, match=r"--server h:1"):  # an abbreviation of --servers
        check_command(["torchrun", "--nproc_per_node", "2", "-m", "fuelline.trainer", "--server", "h:1"], "example")
    with pytest.raises(pytest.fail.Exception, match=r"not a fuelline or torchrun"):
        check_command(["sh", "-c", "fuelline serve /data"], "example")
    cmd = check_command(["torchrun", "--nproc_per_node", "2", "-m", "fuelline.trainer", "--servers", "h:1"], "example")
    assert cmd.trainer.servers == ["h:1"] and nproc_per_node(cmd) == "2"


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
# systemd


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as systemd reads it: sections of keys, each with every value it was given
    (keys may repeat), backslash-continued lines joined, comments dropped."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        if not pending and (not text or text[0] in "#;"):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        line, pending = pending + text, ""
        if line.startswith("[") and line.endswith("]"):
            section = sections.setdefault(line[1:-1], {})
            continue
        key, eq, value = line.partition("=")
        assert eq and section is not None, f"{path.name}:{number}: not KEY=VALUE inside a section: {line}"
        section.setdefault(key.strip(), []).append(value.strip())
    assert not pending, f"{path.name}: ends inside a continued line"
    return sections


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        if not text or text[0] in "#;":
            continue
        key, eq, value = text.partition("=")
        assert eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path.name}:{number}: not KEY=VALUE: {text}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def expand_exec(line: str, env: dict[str, str], instance: str) -> tuple[list[str], set[str]]:
    """ExecStart as systemd runs it: specifiers, then ``${VAR}`` (one argument, as it is) and a
    word that is only ``$VAR`` (split at whitespace: zero or more arguments). Returns the
    arguments and the variables used."""
    line = line.replace("%%", "\0").replace("%i", instance).replace("%I", instance).replace("\0", "%")
    line = line.lstrip("-@:+!")  # ExecStart's prefixes
    used: set[str] = set()

    def value(name: str) -> str:
        assert name in env, f"ExecStart uses ${name}, which {ENV_EXAMPLE.name} does not set"
        used.add(name)
        return env[name]

    argv: list[str] = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            argv.extend(value(whole.group(1)).split())
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: value(m.group(1)), word))
    return argv, used


def _one(section: dict[str, list[str]], key: str) -> str:
    assert key in section, f"{UNIT.name}: no {key}="
    return section[key][-1]


def test_systemd_unit_has_the_expected_keys():
    unit = read_unit(UNIT)
    assert {"Unit", "Service", "Install"} <= set(unit), f"{UNIT.name}: sections {sorted(unit)}"
    service = unit["Service"]
    assert UNIT.name.endswith("@.service"), "a template unit: the instance name is the dataset's"
    dynamic = service.get("DynamicUser", ["no"])[-1] == "yes"
    assert dynamic or _one(service, "User") not in ("", "root", "0"), "runs as a dedicated user"
    assert _one(service, "Restart") == "on-failure"
    assert float(_one(service, "RestartSec").rstrip("s")) > 0
    assert _one(service, "KillSignal") == "SIGTERM", "the server exits 0 on SIGTERM after telling clients"
    assert int(_one(service, "TimeoutStopSec").rstrip("s")) > 0
    for key, want in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                      ("ProtectHome", "yes")):
        assert _one(service, key) == want, f"{key}={want}"
    assert "%i" in _one(service, "EnvironmentFile"), "each instance reads its own environment file"
    assert _one(unit["Install"], "WantedBy") == "multi-user.target"
    # With ProtectSystem=strict nothing is writable unless granted: the cache directory is.
    assert "CacheDirectory" in service or "ReadWritePaths" in service


def _exec_variants() -> Iterator[tuple[str, dict[str, str]]]:
    """The example's values, then each commented ``#   FUELLINE_EXTRA_ARGS=...`` example."""
    env = read_env_file(ENV_EXAMPLE)
    yield ENV_EXAMPLE.name, env
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.fullmatch(r"#\s+(FUELLINE_[A-Z_]+)=(.+)", line.strip())
        if match:
            yield f"{ENV_EXAMPLE.name} with {match.group(1)}={match.group(2)}", {**env, match.group(1): match.group(2)}


def test_systemd_execstart_parses_with_the_example_environment():
    unit = read_unit(UNIT)
    exec_start = _one(unit["Service"], "ExecStart")
    env = read_env_file(ENV_EXAMPLE)
    variants = list(_exec_variants())
    assert len(variants) > 1, "the example shows FUELLINE_EXTRA_ARGS in use"
    used: set[str] = set()
    for label, values in variants:
        argv, uses = expand_exec(exec_start, values, INSTANCE)
        used |= uses
        assert PurePosixPath(argv[0]).is_absolute(), f"ExecStart needs an absolute program path: {argv[0]}"
        cmd = check_command(argv, f"{UNIT.name} ExecStart ({label})")
        assert cmd.serves, cmd.show()
        ns = cmd.fuelline
        assert ns.dataset == env["FUELLINE_DATASET"], cmd.show()
        assert (ns.host, ns.port) == (env["FUELLINE_HOST"], int(env["FUELLINE_PORT"])), cmd.show()
        assert ns.curve_keys == env["FUELLINE_CURVE_KEYS"] == "/etc/fuelline/keys", cmd.show()
    unused = set(env) - used
    assert not unused, f"{ENV_EXAMPLE.name} sets what ExecStart never uses: {sorted(unused)}"


def test_systemd_unit_can_read_the_dataset_and_the_keys():
    service = read_unit(UNIT)["Service"]
    env = read_env_file(ENV_EXAMPLE)
    readable = [p.lstrip("-+") for value in service.get("ReadOnlyPaths", []) for p in value.split()]
    for name in ("FUELLINE_DATASET", "FUELLINE_CURVE_KEYS"):
        assert any(under(env[name], d) for d in readable), f"{name}={env[name]} is not under ReadOnlyPaths {readable}"
        assert not under(env[name], "/home"), f"{name}: ProtectHome=yes hides /home"


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


def _healthcheck_port(test: Sequence[str], where: str) -> int:
    """The port a ``python -c`` TCP health check connects to; the code must compile."""
    test = list(test)
    if test and test[0] in ("CMD", "CMD-SHELL"):
        test = test[1:]
    assert test[:2] == ["python", "-c"] and len(test) == 3, f"{where}: a `python -c` TCP check, got {test}"
    compile(test[2], where, "exec")
    match = re.search(r"create_connection\(\(\s*['\"][^'\"]+['\"]\s*,\s*(\d+)\s*\)", test[2])
    assert match, f"{where}: the check connects to no port: {test[2]}"
    return int(match.group(1))


def _setup_cfg_inputs() -> tuple[set[str], set[str]]:
    """The top-level folders setup.cfg maps into the namespace, and the files it builds from."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    folders = set()
    for line in cfg.get("options", "package_dir").splitlines():
        if "=" in line:
            folders.add(line.split("=", 1)[1].strip().split("/")[0])
    files = {"pyproject.toml", "setup.cfg"}
    for value in cfg["metadata"].values():
        if value.strip().startswith("file:"):
            files.update(f.strip() for f in value.split(":", 1)[1].split(","))
    return folders, files


@pytest.mark.parametrize("name", ["Dockerfile.server", "Dockerfile.trainer"])
def test_dockerfile_copies_what_the_package_is_built_from(name):
    dockerfile = read_dockerfile(CONTAINER / name)
    copied = set()
    for rest in dockerfile.all("COPY"):
        words = [w for w in rest.split() if not w.startswith("--")]
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path in the repository"
            copied.add(source.rstrip("/"))
    folders, files = _setup_cfg_inputs()
    missing = (folders | files) - copied
    assert not missing, f"{name} does not COPY {sorted(missing)}, which setup.cfg builds the package from"
    ignore = (CONTAINER / f"{name}.dockerignore").read_text().splitlines()
    if "*" in ignore:  # an allow-list: everything copied must be let in
        missing = {c for c in copied if f"!{c}" not in ignore}
        assert not missing, f"{name}.dockerignore keeps {sorted(missing)} out of the build context"
    user = dockerfile.last("USER")
    assert user is not None and user.split(":")[0] not in ("root", "0"), f"{name}: runs as a non-root USER"
    # Numeric, so that Kubernetes' runAsNonRoot can check it.
    assert user.split(":")[0].isdigit(), f"{name}: USER {user} should be a numeric uid"
    assert dockerfile.last("FROM") == "python:3.11-slim", name
    stop = dockerfile.last("STOPSIGNAL")
    assert stop in (None, "SIGTERM"), f"{name}: STOPSIGNAL {stop}"


def test_server_dockerfile_installs_no_torch_and_serves_on_5557():
    dockerfile = read_dockerfile(CONTAINER / "Dockerfile.server")
    text = dockerfile.path.read_text()
    assert "torch" not in text.lower(), "the data-server image must not install torch (nor mention it)"
    assert "[trainer]" not in text, "the data-server image installs the package without the trainer extra"
    installs = [rest for rest in dockerfile.all("RUN") if re.search(r"pip install[^&;]*\s\.(\s|$)", rest)]
    assert installs, "Dockerfile.server runs `pip install .`"
    assert dockerfile.entrypoint == ["fuelline"]
    cmd = check_command(dockerfile.entrypoint + dockerfile.cmd, "Dockerfile.server ENTRYPOINT + CMD")
    ns = cmd.fuelline
    assert cmd.serves, cmd.show()
    assert (ns.dataset, ns.host, ns.port, ns.curve_keys) == ("/data", "0.0.0.0", 5557, "/keys"), cmd.show()
    assert dockerfile.all("EXPOSE") == [str(ns.port)], "EXPOSE the port the CMD serves on"
    health = dockerfile.last("HEALTHCHECK")
    assert health is not None and " CMD " in f" {health} ", "Dockerfile.server has a HEALTHCHECK"
    test = json.loads(health.split("CMD", 1)[1])
    assert _healthcheck_port(test, "Dockerfile.server HEALTHCHECK") == ns.port


def test_trainer_dockerfile_installs_the_trainer_extra():
    dockerfile = read_dockerfile(CONTAINER / "Dockerfile.trainer")
    assert any(re.search(r"pip install[^&;]*\.\[trainer\]", rest) for rest in dockerfile.all("RUN")), (
        "Dockerfile.trainer installs `.[trainer]`")
    cmd = check_command(dockerfile.entrypoint + dockerfile.cmd, "Dockerfile.trainer ENTRYPOINT + CMD")
    assert cmd.trainer is not None, cmd.show()


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


def test_compose_command_lines_parse():
    services = compose_services()
    servers = [s for s in services.values() if s.command.serves]
    trainers = [s for s in services.values() if s.command.trainer is not None]
    assert len(servers) >= 2 and len(trainers) >= 1, f"two data servers and a trainer: {sorted(services)}"
    assert len(servers) + len(trainers) == len(services), "every service is a data server or a trainer"


def test_compose_servers_have_health_checks_mounts_and_restart_policies():
    networks = compose().get("networks") or {}
    for service in compose_services().values():
        if not service.command.serves:
            continue
        where, spec, ns = f"compose.yaml service {service.name}", service.spec, service.command.fuelline
        restart = str(spec.get("restart", ""))
        assert restart in ("always", "unless-stopped") or restart.startswith("on-failure"), f"{where}: restart policy"
        assert spec.get("stop_signal", "SIGTERM") == "SIGTERM", where
        assert _healthcheck_port(spec["healthcheck"]["test"], f"{where} healthcheck") == ns.port, where
        mounts = service.mounts()
        assert mounts.get(ns.dataset) is True, f"{where}: the dataset {ns.dataset} is a read-only mount"
        if ns.curve_keys:
            assert mounts.get(ns.curve_keys) is True, f"{where}: the keys {ns.curve_keys} are a read-only mount"
        else:
            # In clear only where nothing outside the project reaches it.
            assert not spec.get("ports"), f"{where}: publishes a port without --curve-keys"
            assert all((networks.get(n) or {}).get("internal") for n in spec.get("networks", ["default"])), (
                f"{where}: serves without --curve-keys on a network that is not internal")


def test_compose_trainer_reads_a_healthy_server_and_keeps_its_checkpoints():
    services = compose_services()
    for service in services.values():
        cmd = service.command
        if cmd.trainer is None:
            continue
        where, spec = f"compose.yaml service {service.name}", service.spec
        for host, port in trainer_targets(cmd):
            assert host in services and services[host].command.serves, f"{where}: --servers {host} is no data server"
            assert port == services[host].command.fuelline.port, f"{where}: {host} does not serve on port {port}"
            depends = spec.get("depends_on") or {}
            assert isinstance(depends, dict) and depends.get(host, {}).get("condition") == "service_healthy", (
                f"{where}: starts once {host} is healthy")
            server_networks = set(services[host].spec.get("networks", ["default"]))
            assert server_networks & set(spec.get("networks", ["default"])), f"{where}: shares no network with {host}"
        # Restarted after a failure only: a finished run must not start again.
        assert str(spec.get("restart", "")).startswith("on-failure"), f"{where}: restart: on-failure"
        if cmd.trainer.checkpoint_dir:
            assert any(under(cmd.trainer.checkpoint_dir, t) and not ro for t, ro in service.mounts().items()), (
                f"{where}: --checkpoint-dir {cmd.trainer.checkpoint_dir} is on no writable volume")


# ---------------------------------------------------------------------------------------------
# Kubernetes


@functools.lru_cache(maxsize=None)
def manifests() -> dict[str, list[dict[str, Any]]]:
    yaml = _yaml()
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(KUBERNETES.glob("*.yaml"))
    }


def _objects(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name, docs in manifests().items() for doc in docs if doc.get("kind") == kind]


@dataclass
class Pod:
    where: str
    kind: str
    owner: dict[str, Any]
    template: dict[str, Any]
    restart_policy: str | None
    env: dict[str, str]  # variables a controller adds to the containers


def pods() -> list[Pod]:
    found = []
    for file, docs in manifests().items():
        for doc in docs:
            kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
            if kind in ("Deployment", "StatefulSet", "Job"):
                template = doc["spec"]["template"]
                found.append(Pod(f"{file} {kind}/{name}", kind, doc, template,
                                 template["spec"].get("restartPolicy"), {}))
            elif kind == "PyTorchJob":
                for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                    found.append(Pod(f"{file} {kind}/{name} {role}", kind, doc, replica["template"],
                                     replica.get("restartPolicy"), PYTORCHJOB_ENV))
    return found


def _expand_k8s(value: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' $(VAR) in command and args ($$ escapes a dollar); an unknown one is an error
    here, though Kubernetes would pass it on as it is."""
    def sub(m: re.Match) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is set by nothing"
        return env[m.group(1)]

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


@dataclass
class Container:
    pod: Pod
    spec: dict[str, Any]
    command: Command

    @property
    def where(self) -> str:
        return f"{self.pod.where} container {self.spec['name']}"

    def mounts(self) -> dict[str, dict[str, Any]]:
        return {m["mountPath"]: m for m in self.spec.get("volumeMounts", [])}

    def volume(self, mount: dict[str, Any]) -> dict[str, Any]:
        volumes = {v["name"]: v for v in self.pod.template["spec"].get("volumes", [])}
        assert mount["name"] in volumes, f"{self.where}: mounts the undeclared volume {mount['name']}"
        return volumes[mount["name"]]


@functools.lru_cache(maxsize=None)
def containers() -> tuple[Container, ...]:
    found = []
    for pod in pods():
        for spec in [*pod.template["spec"].get("initContainers", []), *pod.template["spec"]["containers"]]:
            where = f"{pod.where} container {spec.get('name')}"
            assert spec.get("image"), f"{where}: no image"
            env = {**pod.env, **{e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}}
            # Kubernetes' rules: command replaces the image's ENTRYPOINT (and drops its CMD), args
            # replace CMD.
            image = image_dockerfile(spec["image"], where)
            command = spec.get("command", image.entrypoint)
            args = spec.get("args", [] if "command" in spec else image.cmd)
            argv = [_expand_k8s(str(a), env, where) for a in [*command, *args]]
            found.append(Container(pod, spec, check_command(argv, where)))
    return tuple(found)


def _servers() -> list[Container]:
    return [c for c in containers() if c.command.serves]


def _trainers() -> list[Container]:
    return [c for c in containers() if c.command.trainer is not None]


def test_kustomization_lists_the_manifests():
    (file, kustomization), = _objects("Kustomization")
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a resource listed twice"
    for resource in listed:
        assert (KUBERNETES / resource).is_file(), f"{file} lists {resource}, which does not exist"
    left_out = set(manifests()) - set(listed) - {file} - set(APPLIED_ALONE)
    assert not left_out, f"{file} does not list {sorted(left_out)}"
    for name in APPLIED_ALONE:
        assert name in manifests(), f"{name} is no longer in deploy/kubernetes: update APPLIED_ALONE"


def test_kubernetes_command_lines_parse():
    assert len(_servers()) >= 1 and len(_trainers()) >= 2, "data servers, a trainer Job and a PyTorchJob"
    for container in containers():
        assert container.command.serves or container.command.trainer is not None, container.command.show()
        resources = container.spec.get("resources", {})
        assert resources.get("requests") and resources.get("limits"), f"{container.where}: resources"


def test_kubernetes_servers_have_probes_and_read_only_dataset_and_keys():
    for server in _servers():
        where, spec, ns = server.where, server.spec, server.command.fuelline
        ports = {p["name"]: p["containerPort"] for p in spec.get("ports", [])}
        assert ns.port in ports.values(), f"{where}: no containerPort {ns.port}"
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in spec and "tcpSocket" in spec[probe], f"{where}: a tcpSocket {probe}"
            port = spec[probe]["tcpSocket"]["port"]
            assert ports.get(port, port) == ns.port, f"{where}: {probe} on {port}, not on {ns.port}"
        assert ns.host == "0.0.0.0", f"{where}: binds {ns.host}, unreachable from other pods"
        mounts = server.mounts()
        dataset = mounts.get(ns.dataset)
        assert dataset and dataset.get("readOnly"), f"{where}: the dataset {ns.dataset} is a read-only mount"
        assert "persistentVolumeClaim" in server.volume(dataset), f"{where}: the dataset is a PVC"
        # On a cluster network the servers encrypt and authenticate.
        assert ns.curve_keys, f"{where}: serves without --curve-keys"
        keys = mounts.get(ns.curve_keys)
        assert keys and keys.get("readOnly"), f"{where}: the keys {ns.curve_keys} are a read-only mount"
        secret = server.volume(keys).get("secret")
        assert secret and secret.get("secretName"), f"{where}: the keys come from a Secret"
        paths = [item["path"] for item in secret.get("items", [])]
        assert not paths or ("server.key_secret" in paths and any(p.startswith("authorized/") for p in paths)), (
            f"{where}: the Secret's items must give --curve-keys server.key_secret and authorized/*.key")
        assert server.pod.restart_policy in (None, "Always"), where
        security = server.pod.template["spec"].get("securityContext", {})
        assert security.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"


def test_kubernetes_service_and_network_policy_fit_the_servers():
    (file, sts), = _objects("StatefulSet")
    services = {doc["metadata"]["name"]: doc for _, doc in _objects("Service")}
    service = services.get(sts["spec"]["serviceName"])
    assert service, f"{file}: no Service {sts['spec']['serviceName']}"
    assert service["spec"].get("clusterIP") == "None", "the StatefulSet's Service is headless"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), "the Service selects the server pods"
    server_port = _servers()[0].command.fuelline.port
    assert [p["port"] for p in service["spec"]["ports"]] == [server_port], "the Service's port is the served one"
    trainer_labels = [c.pod.template["metadata"]["labels"] for c in _trainers()]
    for file, policy in _objects("NetworkPolicy"):
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items(), f"{file}: selects the server pods"
        rules = spec["ingress"]
        assert any(p["port"] == server_port for rule in rules for p in rule.get("ports", [])), f"{file}: port"
        allowed = [peer["podSelector"]["matchLabels"] for rule in rules for peer in rule.get("from", [])
                   if "podSelector" in peer]
        for pod_labels in trainer_labels:
            assert any(a.items() <= pod_labels.items() for a in allowed), f"{file}: lets no trainer in ({pod_labels})"


def test_kubernetes_trainers_read_a_server_and_restart_on_failure():
    (_, sts), = _objects("StatefulSet")
    service_name, replicas = sts["spec"]["serviceName"], sts["spec"]["replicas"]
    server_port = _servers()[0].command.fuelline.port
    names = {service_name} | {f"{sts['metadata']['name']}-{i}.{service_name}" for i in range(replicas)}
    for trainer in _trainers():
        where, cmd = trainer.where, trainer.command
        for host, port in trainer_targets(cmd):
            assert host in names and port == server_port, f"{where}: --servers {host}:{port} is none of {sorted(names)}"
        assert trainer.pod.restart_policy in ("OnFailure", "Never"), f"{where}: a restartPolicy that ends"
        if cmd.trainer.checkpoint_dir:
            writable = [m for path, m in trainer.mounts().items()
                        if under(cmd.trainer.checkpoint_dir, path) and not m.get("readOnly")]
            assert writable, f"{where}: --checkpoint-dir {cmd.trainer.checkpoint_dir} is on no writable volume"
            assert "persistentVolumeClaim" in trainer.volume(writable[0]), f"{where}: checkpoints on a PVC"
        if trainer.pod.kind == "PyTorchJob":
            assert trainer.spec["name"] == "pytorch", f"{where}: the operator runs the container named pytorch"
            assert str(trainer.pod.owner["spec"].get("nprocPerNode")) == nproc_per_node(cmd), (
                f"{where}: nprocPerNode and torchrun's --nproc_per_node differ")


# ---------------------------------------------------------------------------------------------
# CURVE between trainers and servers


def test_trainers_present_keys_to_curve_servers():
    if not trainer_accepts_curve_keys():
        pytest.skip("fuelline.trainer has no --curve-keys: trainers cannot read servers that use CURVE "
                    "(deploy/kubernetes/README.md, 'CURVE and the trainer')")
    compose_servers = {name: s.command for name, s in compose_services().items() if s.command.serves}
    for service in compose_services().values():
        if service.command.trainer is not None:
            for host, _ in trainer_targets(service.command):
                if compose_servers[host].fuelline.curve_keys:
                    keys = service.command.trainer.curve_keys
                    assert keys and service.mounts().get(keys) is True, (
                        f"compose.yaml service {service.name}: reads the CURVE server {host} without "
                        "--curve-keys on a read-only mount")
    if any(s.command.fuelline.curve_keys for s in _servers()):
        for trainer in _trainers():
            keys = trainer.command.trainer.curve_keys
            mount = trainer.mounts().get(keys) if keys else None
            assert mount and mount.get("readOnly"), (
                f"{trainer.where}: reads CURVE servers without --curve-keys on a read-only mount")
