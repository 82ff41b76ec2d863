"""deploy/systemd stays true to the code, without systemd: the unit's keys, its ExecStart parsed
with the example environment file's values by ``fuelline``'s own parser, and the paths the
service may read. First, the command-line checker every deploy test relies on, checked itself."""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Iterator

import pytest

from support.deploy import SYSTEMD, check_command, nproc_per_node, under

UNIT = SYSTEMD / "fuelline-serve@.service"
ENV_EXAMPLE = SYSTEMD / "fuelline-serve.env.example"
INSTANCE = "amigos"  # %i when the unit's specifiers are expanded


# ---------------------------------------------------------------------------------------------
# The command-line checker


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
