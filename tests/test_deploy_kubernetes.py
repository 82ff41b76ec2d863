"""deploy/kubernetes stays true to the code, without a cluster: the containers' command and args
(on top of the image's ENTRYPOINT where only args are given) parsed by the project's parsers,
probes, mounts, the Service and NetworkPolicy, restart policies and which server each trainer
reads; that the conversion Jobs' parts cover the dataset, their finish fits them, and the servers
serve what they write; and, across compose and Kubernetes, that trainers present keys to CURVE
servers."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from support.deploy import (
    KUBERNETES,
    Command,
    _yaml,
    check_command,
    compose_services,
    image_dockerfile,
    nproc_per_node,
    trainer_accepts_curve_keys,
    trainer_targets,
    under,
)

# Manifests that kustomization.yaml leaves out on purpose, and why.
APPLIED_ALONE = {
    "trainer-pytorchjob.yaml": "needs the Kubeflow training operator's CRD",
    "convert-job.yaml": "fills the dataset volume once, before the servers serve it",
    "convert-finish-job.yaml": "runs once the parts of convert-job.yaml are complete",
}

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
            if kind == "Job" and doc["spec"].get("completionMode") == "Indexed":
                # One pod per index, each with the index the Job controller gives it.
                template = doc["spec"]["template"]
                for index in range(int(doc["spec"]["completions"])):
                    found.append(Pod(f"{file} {kind}/{name} index {index}", kind, doc, template,
                                     template["spec"].get("restartPolicy"), {"JOB_COMPLETION_INDEX": str(index)}))
            elif kind in ("Deployment", "StatefulSet", "Job"):
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


def _converters() -> list[Container]:
    return [c for c in containers() if c.command.fuelline is not None and c.command.fuelline.command == "convert"]


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
    assert len(_converters()) >= 2, "the conversion's parts and its finish"
    for container in containers():
        assert container.command.serves or container.command.trainer is not None or container in _converters(), (
            container.command.show())
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


def test_kubernetes_convert_parts_cover_the_dataset_and_the_finish_fits_them():
    parts = [c for c in _converters() if c.command.fuelline.part is not None]
    finishes = [c for c in _converters() if c.command.fuelline.finish is not None]
    assert parts and finishes, "an Indexed Job of parts and a Job that finishes them"
    jobs = {id(c.pod.owner): c.pod.owner for c in parts}
    assert len(jobs) == 1, "one Job converts the parts"
    (job,) = jobs.values()
    spec, where = job["spec"], f"Job/{job['metadata']['name']}"
    assert spec.get("completionMode") == "Indexed", f"{where}: pod I converts part I"
    completions = int(spec["completions"])
    assert 1 <= int(spec.get("parallelism", 1)) <= completions, f"{where}: parallelism"
    # Every index converts its own part of the same N, and together they are every part.
    assert sorted(c.command.fuelline.part for c in parts) == [(i, completions) for i in range(completions)], (
        f"{where}: --part must be $(JOB_COMPLETION_INDEX)/{completions}")
    for c in parts:
        declared = {e["name"]: e for e in c.spec.get("env", [])}.get("JOB_COMPLETION_INDEX")
        if declared is not None:
            field = declared.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            assert field == "metadata.annotations['batch.kubernetes.io/job-completion-index']", c.where
        assert c.pod.restart_policy in ("OnFailure", "Never"), f"{c.where}: a restartPolicy that ends"
    same = ("raw", "dataset", "val_fraction", "seed", "recordings_per_shard")
    want = {k: getattr(parts[0].command.fuelline, k) for k in same}
    for c in [*parts, *finishes]:
        ns = c.command.fuelline
        assert {k: getattr(ns, k) for k in same} == want, f"{c.where}: not the parts' RAW, DATASET and options"
        assert c.pod.restart_policy in ("OnFailure", "Never"), f"{c.where}: a restartPolicy that ends"
    for c in finishes:
        assert c.command.fuelline.finish == completions, f"{c.where}: --finish {completions}, the parts' N"
    # On the servers' dataset volume, writable, and the servers serve the very folder DATASET becomes.
    (server,) = {id(s.pod.owner): s for s in _servers()}.values()
    served = server.mounts()[server.command.fuelline.dataset]
    claim = server.volume(served)["persistentVolumeClaim"]["claimName"]
    for c in [*parts, *finishes]:
        ns = c.command.fuelline
        for path in (ns.raw, ns.dataset):
            mount = next((m for p, m in c.mounts().items() if under(path, p)), None)
            assert mount is not None, f"{c.where}: {path} is on no volume"
            assert "persistentVolumeClaim" in c.volume(mount), f"{c.where}: {path} is on no PVC"
        mount_path, mount = next((p, m) for p, m in c.mounts().items() if under(ns.dataset, p))
        assert not mount.get("readOnly"), f"{c.where}: writes {ns.dataset} on a read-only mount"
        assert c.volume(mount)["persistentVolumeClaim"]["claimName"] == claim, (
            f"{c.where}: writes the dataset on another volume than the servers' {claim}")
        inside = str(PurePosixPath(ns.dataset).relative_to(mount_path))
        assert served.get("subPath") == inside, (
            f"{c.where}: writes {inside}/ of the volume, the servers serve {served.get('subPath') or 'its root'}")


# ---------------------------------------------------------------------------------------------
# CURVE between trainers and servers


def test_trainers_present_keys_to_curve_servers():
    # A trainer without --curve-keys cannot read a CURVE server: that is a failure, never a skip.
    assert trainer_accepts_curve_keys(), ("fuelline.trainer has no --curve-keys: trainers cannot read servers "
                                          "that use CURVE (deploy/kubernetes/README.md, 'CURVE and the trainer')")
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
