"""The layers of DESIGN.md hold: the protocol imports no other fuelline package, the client only
the protocol, the server never the client's stream machinery, the trainer or torch; a trainer rank
loads neither the server nor pyarrow; and no two modules import each other, directly or round a
circle, even through imports inside functions (which hide the graph from a reader, not from this)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"protocol": "fuelline.protocol", "server": "fuelline.server", "client": "fuelline.client",
            "trainer": "fuelline.trainer"}
# Who may import whom (a package always may import itself).
ALLOWED = {
    "protocol": set(),
    "client": {"protocol"},
    "trainer": {"protocol", "client"},
    # The one `fuelline` command registers the client's `stream` command (fuelline.client.command).
    "server": {"protocol"},
}
SERVER_MAY_IMPORT = {"fuelline.client.command"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((package, *parts))] = path
    return mods


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The fuelline modules ``path`` imports anywhere in it; ``from pkg import mod`` is ``pkg.mod``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fuelline"):
            submodules = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= submodules if len(submodules) == len(node.names) else submodules | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fuelline")}
    return found & MODULES.keys()


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_the_module_list_is_real() -> None:
    assert "fuelline.client.stream" in GRAPH and "fuelline.server.serving.server" in GRAPH
    assert "fuelline.protocol" in GRAPH["fuelline.client.stream"]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer: str) -> None:
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in GRAPH.items() if name.split(".")[1] == layer
        for dep in deps
        if dep.split(".")[1] not in ALLOWED[layer] | {layer} and not (layer == "server" and dep in SERVER_MAY_IMPORT)
    )
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    # A package's __init__ that re-exports its modules is not a circle with them.
    graph = {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in GRAPH.items()}
    assert _cycles(graph) == []


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def _heavy(loaded: set[str], *names: str) -> list[str]:
    return sorted(m for m in loaded if m.split(".")[0] in names or m == "fuelline.server" or m.startswith("fuelline.server."))


def test_the_client_loads_neither_the_server_nor_pyarrow_nor_torch() -> None:
    loaded = _loaded_after("import fuelline.client, fuelline.client.command\nfrom fuelline.client import ServerDataStream")
    assert "fuelline.client.stream" in loaded
    assert _heavy(loaded, "pyarrow", "torch") == []


def test_a_trainer_rank_loads_neither_the_server_nor_pyarrow() -> None:
    pytest.importorskip("torch")
    loaded = _loaded_after("import fuelline.trainer.train, fuelline.trainer.cli, fuelline.trainer.model_spec")
    assert "torch" in loaded and "fuelline.client.stream" in loaded
    assert _heavy(loaded, "pyarrow") == []


def test_the_server_and_its_command_line_load_no_torch() -> None:
    server = [m for m in MODULES if m.startswith("fuelline.server") and not m.endswith("__main__")]
    loaded = _loaded_after("import importlib\nfrom fuelline.server.cli.main import build_parser\nbuild_parser()\n"
                           f"for m in {server!r}:\n    importlib.import_module(m)")
    assert "fuelline.server.serving.server" in loaded and "pyarrow" in loaded
    assert sorted(m for m in loaded if m.split(".")[0] == "torch") == []
