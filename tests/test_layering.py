"""The package's layering, read from the source with ``ast`` (no imports run): every ``import`` and ``from ...
import`` statement, at module level or inside a function, is an edge from its module to the ``roofline``
module it names (a package's ``__init__`` when a name is not a submodule). Imports under ``if TYPE_CHECKING:``
never run and are left out.

- ``roofline.engine`` imports neither ``roofline.worker`` nor ``roofline.hardware``: the engine drives an
  ``Executor`` handed in (``roofline.step``), and the speculative controller gets a measured ``DeviceProfile``.
- ``roofline.kernels`` imports neither ``roofline.quant`` nor ``roofline.layers`` (kernels sit below both).
- ``roofline`` has no import cycle.

A failure prints the offending import chain, each edge with the file and line of its import statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "roofline"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """module -> the roofline modules it imports; (module, imported) -> "file:line" of the first such import."""
    files = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    where: dict[tuple[str, str], str] = {}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue  # ``if TYPE_CHECKING:`` imports never run
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                if not t.startswith("roofline"):
                    continue
                dst = resolve(t)
                if dst is None or dst == mod:
                    continue
                if isinstance(node, ast.ImportFrom) and t == (node.module or "") and len(targets) > 1:
                    # ``from pkg import name``: the edge is to pkg.name when that is a module, else to pkg.
                    if any(resolve(x) not in (None, dst) for x in targets[:-1]):
                        continue
                graph[mod].add(dst)
                where.setdefault((mod, dst), f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return graph, where


GRAPH, WHERE = _import_graph()


def _chain(path: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}  ({WHERE[(a, b)]})" for a, b in zip(path, path[1:], strict=False))


def _reaches(src_prefix: str, forbidden: tuple[str, ...]) -> list[str] | None:
    """An import path from a module under ``src_prefix`` to one under a ``forbidden`` prefix, through
    modules under ``src_prefix`` only (the direct layering), or None."""
    def under(m: str, prefixes: tuple[str, ...]) -> bool:
        return any(m == p or m.startswith(p + ".") for p in prefixes)

    for start in sorted(m for m in GRAPH if under(m, (src_prefix,))):
        stack, seen = [[start]], {start}
        while stack:
            path = stack.pop()
            for nxt in sorted(GRAPH[path[-1]]):
                if under(nxt, forbidden):
                    return path + [nxt]
                if nxt not in seen and under(nxt, (src_prefix,)):
                    seen.add(nxt)
                    stack.append(path + [nxt])
    return None


def _cycles() -> list[list[str]]:
    """One import cycle (a path whose last module is its first) per strongly connected group of roofline
    modules that import each other (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for m in sorted(GRAPH):
        if m not in index:
            connect(m)
    cycles = []
    for group in groups:  # a path inside the group back to its first module
        start = min(group)
        prev: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for a in frontier:
                for b in sorted(GRAPH[a] & group):
                    if b == start:
                        found = a
                        break
                    if b not in prev:
                        prev[b] = a
                        nxt.append(b)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        node = found
        while node is not None and node != start:
            path.insert(1, node)
            node = prev.get(node)
        cycles.append(path + [start])
    return cycles


CYCLES = _cycles()
# Cycles in another branch's area of issue 27: the kernel split removes the quant_gemm <-> quant_gemv imports.
OTHERS = ("roofline.kernels.",)


def test_the_graph_sees_function_level_imports():
    """The parser itself: an import inside a function counts (the engine factory starts the worker lazily), and
    a ``from pkg import module`` edge goes to the module."""
    assert "roofline.worker.executor" in GRAPH["roofline.engine_factory"]
    assert "roofline.worker.multiproc_executor" in GRAPH["roofline.engine_factory"]  # inside build_executor
    assert "roofline.worker.scoring" in GRAPH["roofline.worker.worker"]  # ``from roofline.worker import scoring``


def test_engine_imports_neither_the_worker_nor_the_hardware_probe():
    path = _reaches("roofline.engine", ("roofline.worker", "roofline.hardware"))
    assert path is None, "roofline.engine reaches a forbidden module:\n" + _chain(path or [])


def test_step_messages_sit_below_the_engine_and_the_worker():
    for mod in ("roofline.step", "roofline.spec_decode.proposer", "roofline.spec_decode.controller"):
        bad = sorted(m for m in GRAPH[mod] if m.startswith(("roofline.engine", "roofline.worker")))
        assert not bad, f"{mod} imports {bad}"


def test_kernels_import_neither_quant_nor_layers():
    path = _reaches("roofline.kernels", ("roofline.quant", "roofline.layers"))
    assert path is None, "roofline.kernels reaches a forbidden module:\n" + _chain(path or [])


def test_no_import_cycle():
    mine = [c for c in CYCLES if not all(m.startswith(OTHERS) for m in c)]
    assert not mine, "import cycle(s):\n" + "\n\n".join(_chain(c) for c in mine)


def test_no_import_cycle_in_kernels():
    assert not CYCLES, "import cycle(s):\n" + "\n\n".join(_chain(c) for c in CYCLES)
