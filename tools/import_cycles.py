"""Count the import cycles among a package's modules, and find policy names compared outside the registry.

    .venv/bin/python tools/import_cycles.py mlfabric/ps            # cycles among mlfabric.ps.*
    .venv/bin/python tools/import_cycles.py mlfabric/ps --policy-names

An *import* is any ``import`` / ``from ... import`` statement in a module's source (at module
level or inside a function: a function-level import is a cycle deferred, not removed), except
those under ``if TYPE_CHECKING:`` (never executed). ``from pkg import name`` is an edge to
``pkg.name`` when that is a module of the package (a compiled extension, ``name.c``, included),
else to ``pkg``. A *cycle* is a strongly
connected component of two or more modules (Tarjan); the script prints each with its modules
and exits 1 if there is any. ``--policy-names`` lists comparisons of a policy's name (a string
compared with ``routing``/``.name``) outside :mod:`mlfabric.ps.policy`, exit 1 if any.
tests/unit/test_ps_policy.py asserts both are zero.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports."""
    files = sorted(package.rglob("*.py"))
    modules = {module_name(f): f for f in files}
    # compiled extensions (``_sched.c`` builds ``_sched``): modules that import nothing of ours
    extensions = {module_name(f): f for f in package.rglob("*.c")}
    graph: dict[str, set[str]] = {m: set() for m in [*modules, *extensions]}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    anchor = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                    src = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in graph else src for a in node.names]
            for target in targets:
                while target and target not in graph:  # import a.b.c of a module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def policy_name_comparisons(package: Path, registry: str = "policy.py") -> list[str]:
    """``file:line`` of every comparison of ``routing`` / ``.name`` with a string constant, and
    every ``getattr`` on a ``routing`` object, outside the registry module."""
    hits = []
    for path in sorted(package.rglob("*.py")):
        if path.name == registry and path.parent == package:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any((isinstance(s, ast.Attribute) and s.attr == "routing")
                            or (isinstance(s, ast.Name) and s.id == "routing") for s in sides)
                strings = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides) or any(
                    isinstance(s, (ast.Tuple, ast.List, ast.Set))
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts) for s in sides)
                if named and strings:
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                    "hasattr"):
                target = node.args[0] if node.args else None
                if isinstance(target, ast.Attribute) and target.attr == "routing":
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


def main(argv: list[str]) -> int:
    package = (ROOT / (argv[0] if argv else "mlfabric/ps")).resolve()
    if "--policy-names" in argv:
        hits = policy_name_comparisons(package)
        for h in hits:
            print(h)
        print(f"{len(hits)} policy-name comparison(s) outside the registry")
        return 1 if hits else 0
    found = cycles(import_graph(package))
    for c in found:
        print(f"cycle of {len(c)}: {', '.join(c)}")
    print(f"{len(found)} import cycle(s) among {module_name(package / '__init__.py')}'s modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
