"""Check that hf_fsdp2's packages import each other without a cycle (lazy imports inside functions included).

Each top-level name under hf_fsdp2/ (a subpackage or a module) is a node; ``A -> B`` when any module of A
imports anything of B. The graph must be acyclic, so the folder tree reads as layers. Run by
scripts/test.sh; exits 1 and prints each cycle otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hf_fsdp2"


def node_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hf_fsdp2" else None


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        source = node_of(".".join(rel.parts))
        if source is None or source == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [
                    f"{node.module}.{a.name}" for a in node.names if node.module == "hf_fsdp2"
                ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = node_of(name)
                if target and target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def main() -> int:
    graph = edges()
    found = cycles(graph)
    for cycle in found:
        print("import cycle: " + " -> ".join(cycle), file=sys.stderr)
    if not found:
        order = []
        remaining = {n: set(d) for n, d in graph.items()}
        nodes = set(graph) | {m for d in graph.values() for m in d}
        while nodes:
            leaves = sorted(n for n in nodes if not (remaining.get(n, set()) & nodes))
            order.append(leaves)
            nodes -= set(leaves)
        print("hf_fsdp2 layers, bottom first: " + " | ".join(", ".join(layer) for layer in order))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
