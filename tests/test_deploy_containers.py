"""deploy/container stays true to the code, without Docker: what the Dockerfiles copy and install,
their ENTRYPOINT and CMD parsed by the project's parsers, and compose's services (command lines,
health checks, mounts, restart policies, which server each trainer reads)."""

from __future__ import annotations

import configparser
import json
import re
from typing import Sequence

import pytest

from support.deploy import (
    CONTAINER,
    ROOT,
    check_command,
    compose,
    compose_services,
    read_dockerfile,
    trainer_targets,
    under,
)

# ---------------------------------------------------------------------------------------------
# Dockerfiles


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
# compose


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
