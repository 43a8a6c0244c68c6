"""Check that hf_fsdp2 imports itself without a cycle, between packages and between files.

Two graphs, lazy imports inside functions included (a lazy import hides a cycle from Python, not from a
reader):

- packages: each top-level name under hf_fsdp2/ (a subpackage or a module) is a node; ``A -> B`` when any
  module of A imports anything of B. Acyclic, so the folder tree reads as layers.
- files: each module is a node (a package's ``__init__`` stands for the package); ``a -> b`` when a imports
  b or a name defined in b. Acyclic, so every file reads with what it stands on below it. A module importing
  its own package's ``__init__`` is not an edge (the package re-exports its modules).

Run by scripts/test.sh; exits 1 and prints each cycle otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hf_fsdp2"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root`` (packages by their name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name ``module`` imports (``from a import b`` gives ``a.b``; relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                kept = parts[: len(parts) - (node.level - 1)]
                base = ".".join(kept + ([node.module] if node.module else []))
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def file_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """The file graph: module -> the modules of the package it imports from."""
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        for name in imported_names(module, path):
            while name and name not in mods:  # ``a.b.func`` -> ``a.b``
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                graph.setdefault(module, set()).add(name)
    return graph


def package_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """The package graph: top-level name under the package -> the top-level names it imports from."""
    top = root.name
    graph: dict[str, set[str]] = {}
    for module, targets in file_edges(root).items():
        source = module.split(".")[1] if module.count(".") else None
        if source is None:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == top and len(parts) > 1 and parts[1] != source:
                graph.setdefault(source, set()).add(parts[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path per cycle found by a depth-first walk (empty when the graph is acyclic)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """The nodes of an acyclic graph, bottom layer first."""
    order = []
    nodes = set(graph) | {m for d in graph.values() for m in d}
    while nodes:
        leaves = sorted(n for n in nodes if not (graph.get(n, set()) & nodes))
        order.append(leaves)
        nodes -= set(leaves)
    return order


def main(root: Path = ROOT) -> int:
    found = [("package", c) for c in cycles(package_edges(root))]
    found += [("file", c) for c in cycles(file_edges(root))]
    for kind, cycle in found:
        print(f"import cycle between {kind}s: " + " -> ".join(cycle), file=sys.stderr)
    if not found:
        order = layers(package_edges(root))
        print(f"{root.name} layers, bottom first: " + " | ".join(", ".join(layer) for layer in order))
        print(f"{len(modules(root))} files, no import cycle between files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
