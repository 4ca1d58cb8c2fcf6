#!/usr/bin/env python3
"""Fails when the modules of a Python package import each other in a cycle.

    scripts/check_imports.py [PACKAGE_DIR]      (default: python/automoe)

Every import statement counts, wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`): `import pkg.x`, `from pkg import x`, `from pkg.x import y` and relative
imports at any depth. `from pkg import name` is an edge to the module `pkg.name` when that is a
file of the package, else to the module that defines `name` (the package's `__init__` when it
binds it; nothing when it is an extension module such as `_C`). Importing `pkg.x` is not counted
as importing `pkg` (Python runs the package's `__init__` first, but that edge is in every import),
also when `pkg.x` is no file here (generated or compiled at build time: the check gives the same
answer on a fresh clone as on a built tree).
Dynamic imports (`importlib.import_module("...")`, names a module-level `__getattr__` serves) are
not seen.

Prints each cycle as a path of modules, each step with the file and line of its import, and exits
1; prints a one-line summary and exits 0 when there is none. Standard library only.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package_dir` (a package is named by
    its directory: pkg/__init__.py is `pkg`, pkg/sub/x.py is `pkg.sub.x`)."""
    root = package_dir.name
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [root, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def top_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (what `from module import name` can find)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def imports(name: str, path: Path, tree: ast.Module, modules: dict[str, Path],
            defines: dict[str, set[str]]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for each import statement in `tree`."""
    is_package = path.name == "__init__.py"
    found = []

    # A dotted name that is no file here (a generated or extension module such as `_build_info`
    # or `_C`, absent from a fresh clone) is no edge, not an edge to its package: the package's
    # `__init__` runs first, but that holds for every import of a submodule.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.append((alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # the package `from .` means: the module's own package, then one up per extra dot
                base = name.split(".") if is_package else name.split(".")[:-1]
                up = node.level - 1
                if up > len(base) - 1:
                    continue  # beyond the top of the package: not ours
                base = base[:len(base) - up]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.append((f"{source}.{alias.name}", node.lineno))
                    continue
                if source not in modules:
                    continue  # not ours, or a submodule that is no file (see above)
                if alias.name != "*" and alias.name not in defines[source]:
                    continue  # a submodule that is no file of ours (an extension such as _C)
                found.append((source, node.lineno))
    return found


def graph(package_dir: Path) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """The modules and, per module, the modules it imports (with the line of the first import)."""
    modules = module_names(package_dir)
    trees = {m: ast.parse(p.read_text(encoding="utf-8"), filename=str(p)) for m, p in modules.items()}
    defines = {m: top_level_names(t) for m, t in trees.items()}
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for m, tree in trees.items():
        for target, line in imports(m, modules[m], tree, modules, defines):
            edges[m].setdefault(target, line)  # (a module importing itself is a cycle too)
    return modules, edges


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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
                out.append(sorted(component))
    return out


def shortest_cycle(start: str, members: set[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges[node]):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle")


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """For each strongly connected component with a cycle: the shortest cycle through each of its
    modules, without repeating a cycle already listed from another of its modules."""
    out = []
    for component in strongly_connected(edges):
        if len(component) == 1 and component[0] not in edges[component[0]]:
            continue
        seen = set()
        for start in component:
            cycle = shortest_cycle(start, set(component), edges)
            key = frozenset(zip(cycle, cycle[1:]))
            if key not in seen:
                seen.add(key)
                out.append(cycle)
    return out


def main(argv: list[str]) -> int:
    default = Path(__file__).resolve().parents[1] / "python" / "automoe"
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    package_dir = Path(argv[0]) if argv else default
    if not (package_dir / "__init__.py").is_file():
        print(f"check_imports: {package_dir} is not a package (no __init__.py)", file=sys.stderr)
        return 2
    modules, edges = graph(package_dir)
    found = cycles(edges)
    def shown(path: Path) -> str:  # relative to the working directory where it is under it
        try:
            return str(path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(path)

    for cycle in found:
        print("import cycle: " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            print(f"    {shown(modules[a])}:{edges[a][b]}: {a} imports {b}")
    if found:
        print(f"check_imports: {len(found)} import cycle(s) among the modules of {shown(package_dir)}")
        return 1
    print(f"check_imports: no import cycle among the {len(modules)} modules of {shown(package_dir)} "
          f"({sum(map(len, edges.values()))} imports between them)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
