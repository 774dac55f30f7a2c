"""The packages import only downward and without cycles.

Every module of `orca_torch/` and `clipper/` is parsed with `ast`; every import counts, at the top
of a file or inside a function, absolute or relative. The layers, lowest first:

- `orca_torch.checks`: the input checks, a leaf (imports nothing of the project).
- `orca_torch.core`: the algorithm (request, batch, scheduler, memory, engine); imports `checks`.
- `orca_torch.specs`: model specs; imports `core` (a step's totals) and `checks`.
- `orca_torch.model` (the torch model) and `orca_torch.sim` (the paper GPU): each imports `core`,
  `specs` and `checks`, and neither imports the other.
- `orca_torch.lab`: the experiment toolkit; imports any layer below it.
- `orca_torch.distributed`: the multi-process executor with its command-line entry and its
  experiment runs, which read `lab`'s workloads and argument types; `lab` does not import it.
- `orca_torch.serve`: the live server over the engine and the torch model; imports any layer up to
  `lab`, and nothing imports it.
- `orca_torch` itself re-exports from `core` and `specs` only, and no module imports it.
- `clipper`: Clipper's design, a package of its own; of `orca_torch` it imports only `checks`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orca_torch", "clipper")

# What each layer may import besides itself.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "checks": frozenset(),
    "core": frozenset({"checks"}),
    "specs": frozenset({"checks", "core"}),
    "model": frozenset({"checks", "core", "specs"}),
    "sim": frozenset({"checks", "core", "specs"}),
    "lab": frozenset({"checks", "core", "specs", "model", "sim"}),
    "distributed": frozenset({"checks", "core", "specs", "model", "sim", "lab"}),
    "serve": frozenset({"checks", "core", "specs", "model", "sim", "lab"}),
    "orca_torch": frozenset({"core", "specs"}),
    "clipper": frozenset({"checks"}),
}



@dataclass(frozen=True)
class Edge:
    source: str       # importing module
    target: str       # imported module (a submodule where `from pkg import name` names one)
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "clipper":
        return "clipper"
    return parts[1] if len(parts) > 1 else "orca_torch"


def imports(module: str, path: Path, modules: dict[str, Path], source: str | None = None) -> list[Edge]:
    """The project modules `module` (the file `path`, or `source` as its text) imports, each with its line."""
    is_package = path.name == "__init__.py"
    edges = []
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module
            # `from pkg import sub` imports the submodule `pkg.sub` where there is one.
            targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in modules else base_name
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                continue
            while target not in modules:        # `import a.b.c` where c is a name, not a module
                target = target.rpartition(".")[0]
            edge = Edge(module, target, path, node.lineno)
            if target != module and edge not in edges:
                edges.append(edge)
    return edges


def all_edges() -> list[Edge]:
    modules = all_modules()
    return [e for m, p in modules.items() for e in imports(m, p, modules)]


def upward(edges: list[Edge]) -> list[str]:
    broken = []
    for e in edges:
        src, dst = layer(e.source), layer(e.target)
        if src == dst and src != "orca_torch":
            continue
        if dst not in MAY_IMPORT[src]:
            allowed = ", ".join(sorted(MAY_IMPORT[src])) or "nothing of the project"
            broken.append(f"{e.where()}: {e.source} imports {e.target}, but {src} may import only {allowed}")
    return broken


def cycles(edges: list[Edge]) -> list[str]:
    """Every strongly connected set of modules (Tarjan), with the imports that close it."""
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph.get(v, []):
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in found:
        inside = [e for m in component for e in graph[m] if e.target in component]
        out.append("import cycle between " + ", ".join(component) + ": "
                   + "; ".join(f"{e.where()} {e.source} -> {e.target}" for e in inside))
    return out


def test_the_parser_sees_imports_of_every_kind():
    source = ("import orca_torch.core.batch\n"                      # absolute, a module
              "from orca_torch.sim import hw_model\n"              # a package named by `from`
              "from . import api\n"                                 # relative, a sibling
              "from ..core.scheduler import Scheduler\n"           # relative, up a level
              "import numpy\n"                                      # not the project's
              "def f():\n"
              "    from orca_torch.lab.workload import chat\n"     # inside a function
              "    import orca_torch.specs.ModelSpec\n")            # a name under a module
    modules = all_modules()
    edges = imports("orca_torch.lab.report", ROOT / "orca_torch/lab/report.py", modules, source)
    assert [(e.target, e.line) for e in edges] == [
        ("orca_torch.core.batch", 1), ("orca_torch.sim.hw_model", 2), ("orca_torch.lab.api", 3),
        ("orca_torch.core.scheduler", 4), ("orca_torch.lab.workload", 7), ("orca_torch.specs", 8)]
    package = imports("clipper", ROOT / "clipper/__init__.py", modules, "from .cache import CachedModel\n")
    assert [e.target for e in package] == ["clipper.cache"]
    assert len(modules) > 60


def test_the_checker_catches_an_upward_import_and_a_cycle():
    fake = [Edge("orca_torch.core.scheduler", "orca_torch.lab.api", ROOT / "orca_torch/core/scheduler.py", 7),
            Edge("orca_torch.lab.api", "orca_torch.core.scheduler", ROOT / "orca_torch/lab/api.py", 9)]
    (message,) = upward(fake)
    assert message.startswith("orca_torch/core/scheduler.py:7: orca_torch.core.scheduler imports orca_torch.lab.api")
    assert "core may import only checks" in message
    (message,) = cycles(fake)
    assert "orca_torch/lab/api.py:9 orca_torch.lab.api -> orca_torch.core.scheduler" in message


def test_imports_go_down_the_layers():
    broken = upward(all_edges())
    assert not broken, "imports up the layers:\n" + "\n".join(broken)


def test_no_import_cycles():
    found = cycles(all_edges())
    assert not found, "\n".join(found)
