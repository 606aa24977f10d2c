"""The import structure of `taco/`: circles and back arrows against the layering of docs/design.md 2.

Every `import` and `from ... import` in every module counts, wherever it stands (module top,
inside a function, under `if TYPE_CHECKING:`): a lazy or type-only import hides a circle from the
interpreter, not from a reader. Two things are not imports of the module: the block under
`if __name__ == "__main__":` (the module run as a script is a program of its own, `__main__`, and
imports the module afresh if at all) and dynamic imports (`importlib.import_module`).

- Module circles: groups of modules that import each other, directly or through others (the
  strongly connected components of the module graph with more than one member), each printed with
  one shortest cycle through it.
- Package circles: the same on the graph of the first-level parts of `taco` (codec, kernels, comm,
  parallel, models, integrations, train, bench, cli and the `taco` facade itself).
- Back arrows: imports from one part into a part it may not use. The layers, lowest first:
  codec <- kernels <- comm <- parallel <- train <- bench <- cli. Models know nothing of
  distribution and sit beside codec at the bottom (only parallel and above import them);
  integrations sit beside train, above parallel: megatron.py routes Megatron's reduce through comm,
  dtensor.py runs parallel's TP regions (the autograd pairs, written once) under DTensor styles;
  they never import train. The `taco` facade re-exports the public API and may only be imported
  from above the layers (bench, cli).

    python benchmarks/structure.py [--root taco]

The last line reads "N circles, M back arrows" (N counts module and package circles together).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from pathlib import Path

LAYERS = ["codec", "kernels", "comm", "parallel", "train", "bench", "cli"]
# part -> the parts it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {p: set(LAYERS[:i]) for i, p in enumerate(LAYERS)}
ALLOWED["models"] = set()
ALLOWED["integrations"] = {"codec", "kernels", "comm", "parallel", "models"}
for _p in ("parallel", "train", "bench", "cli"):
    ALLOWED[_p] |= {"models"}
for _p in ("train", "bench", "cli"):
    ALLOWED[_p] |= {"integrations"}
ALLOWED["bench"] |= {"taco"}
ALLOWED["cli"] |= {"taco"}
ALLOWED["taco"] = set(ALLOWED) - {"bench", "cli", "taco"}  # the facade re-exports the layers


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package's name is its __init__)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def is_main_block(node: ast.stmt) -> bool:
    """Whether `node` is `if __name__ == "__main__":`."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    return (
        isinstance(t.left, ast.Name) and t.left.id == "__name__" and len(t.comparators) == 1
        and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == "__main__"
    )  # fmt: skip


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` (at `path`) imports, most specific name first."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    tree = ast.parse(path.read_text(), str(path))
    tree.body = [n for n in tree.body if not is_main_block(n)]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` names a module when sub is one, else an attribute of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            m = resolve(t)
            if m is not None and m != name:
                found.add(m)
    return found


def part(module: str) -> str:
    """The first-level part of taco a module belongs to ("taco" for the facade itself)."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else bits[0]


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def shortest_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One shortest cycle through the first node of `comp`, staying inside `comp`."""
    inside, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def analyse(root: Path) -> tuple[list[list[str]], list[list[str]], list[tuple[str, str]], dict]:
    """(module circles, package circles, back arrows as (importer, imported), module graph)."""
    modules = module_names(root)
    graph = {m: imports_of(m, f, modules) for m, f in modules.items()}
    packages: dict[str, set[str]] = {}
    for m, deps in graph.items():
        packages.setdefault(part(m), set()).update(part(d) for d in deps if part(d) != part(m))
    back = [
        (m, d)
        for m, deps in sorted(graph.items())
        for d in sorted(deps)
        if part(d) != part(m) and part(d) not in ALLOWED.get(part(m), set())
    ]
    return components(graph), components(packages), back, {"modules": graph, "packages": packages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "taco")
    args = ap.parse_args(argv)
    mod_circles, pkg_circles, back, graphs = analyse(args.root)
    for comp in mod_circles:
        print("module circle: " + " -> ".join(shortest_cycle(graphs["modules"], comp)))
    for comp in pkg_circles:
        print("package circle: " + " -> ".join(shortest_cycle(graphs["packages"], comp)))
    for m, d in back:
        print(f"back arrow: {m} ({part(m)}) imports {d} ({part(d)})")
    print(f"{len(mod_circles) + len(pkg_circles)} circles, {len(back)} back arrows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
