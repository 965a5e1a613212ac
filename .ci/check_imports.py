"""Import rules import-linter has no contract for: no cycles, no borrowed privates.

``python .ci/check_imports.py`` exits 1, naming each offence, when

* two or more modules of ``celery_pulse`` import each other, directly or round a longer
  circle (import-linter's ``acyclic_siblings`` sees packages, not modules); or
* a module imports another module's private name (``from celery_pulse.a import _b``): what
  two rooms share gets a public name in one of them.

Migration revision files are left out (Alembic loads them by path, nobody imports them).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "celery_pulse"


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph.modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def borrowed_privates() -> list[str]:
    """``file:line: from X import _y`` for every private name taken from another module."""
    found = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        if "migrations" in path.parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            ours = node.level > 0 or (node.module or "").split(".")[0] == PACKAGE \
                if isinstance(node, ast.ImportFrom) else False
            if isinstance(node, ast.ImportFrom) and ours:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                     f"from {'.' * node.level}{node.module or ''} import {alias.name}")
    return found


def main() -> int:
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(PACKAGE)
    for module in [m for m in graph.modules if ".migrations." in m]:
        graph.remove_module(module)
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    problems += [f"private name imported: {p}" for p in borrowed_privates()]
    for problem in problems:
        print(problem)
    print(f"{len(graph.modules)} modules: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
