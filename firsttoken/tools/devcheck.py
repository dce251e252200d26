"""Developer checks over the source tree. ``python -m firsttoken.tools.devcheck imports`` draws
which package imports which and lists every import that points up the layers (docs/architecture.md,
"Layers"); it exits 1 if there is one. ``python -m firsttoken.tools.devcheck unreachable`` lists
statements that can never run (after a ``return``, ``raise``, ``continue`` or ``break`` in the same
block); it exits 1 if there is one.

Layers, top to bottom. A module may import its own package, any package of a lower layer, and
nothing above it; packages that share a layer may not import each other (they are siblings:
scheduler and runner meet only through firsttoken/batch.py). Within a package, modules may not
import each other in a circle (``import_circles``): a value two modules share lives in a third,
lower one.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),  # the firsttoken command
    # the offline Python API; operator tools (they talk HTTP or do arithmetic); how a server is
    # assembled from the config (one engine, or replicas on Ray Serve)
    ("llm", "tools", "serving"),
    ("assembly",),  # the engine and the input processor from the config: one place for all of them
    ("api",),  # the HTTP server; its intake asks the engine's admission between the processor's steps
    ("inputs",),  # prompts -> EngineRequest
    ("engine",),  # the step loop, the asyncio bridge, detokenizer
    ("scheduler", "runner"),  # bookkeeping (ints only) / tensors, behind the Executor
    # a model built for this machine: the plan (auto settled), each linear layer's method, the
    # loader
    ("loading",),
    # structured: grammars, matchers, the bitmask
    ("models", "sampling", "kv", "metrics", "structured"),
    # the backend contract models use; the CPU kernels loading's layer methods call
    ("attention", "kernels"),
    ("batch", "config"),  # scheduler -> runner values; the config tree
    ("types", "quoting", "units", "version", "device_memory"),  # leaves
)
LAYER_OF = {pkg: depth for depth, layer in enumerate(LAYERS) for pkg in layer}


@dataclass(frozen=True)
class Import:
    module: str  # firsttoken.<...> of the importing file
    imported: str  # firsttoken.<...>
    line: int

    @property
    def source(self) -> str:
        return _package(self.module)

    @property
    def target(self) -> str:
        return _package(self.imported)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def iter_imports(root: Path = PACKAGE_ROOT) -> Iterator[Import]:
    """Every ``import firsttoken...`` / ``from firsttoken... import`` in the package, lazy imports
    included."""
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("firsttoken")
            ):
                if node.module == "firsttoken":  # from firsttoken import units
                    for alias in node.names:
                        yield Import(module, f"firsttoken.{alias.name}", node.lineno)
                else:
                    yield Import(module, node.module, node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("firsttoken."):
                        yield Import(module, alias.name, node.lineno)


def _module_paths(root: Path) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def import_circles(root: Path = PACKAGE_ROOT) -> list[tuple[str, ...]]:
    """Every set of modules that import one another in a circle (lazy imports included;
    ``from firsttoken.cli import serve`` is an import of ``firsttoken.cli.serve``), each sorted,
    largest first."""
    modules = _module_paths(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("firsttoken")
            ):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    graph[module].add(name if name in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names if a.name.startswith("firsttoken."))
    return sorted((c for c in _strongly_connected(graph) if len(c) > 1), key=lambda c: (-len(c), c))


def _strongly_connected(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Tarjan's components of ``graph`` (edges to names outside it ignored), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is None:
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
                    out.append(tuple(sorted(component)))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return out


def violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        src, dst = imp.source, imp.target
        if src == dst or src == "__init__":
            continue
        if src not in LAYER_OF or dst not in LAYER_OF:
            out.append(f"{imp.module}:{imp.line}: {src} or {dst} is in no layer (add it to devcheck.LAYERS)")
        elif LAYER_OF[dst] < LAYER_OF[src]:
            out.append(f"{imp.module}:{imp.line} imports {imp.imported}: {src} may not import {dst} (upward)")
        elif LAYER_OF[dst] == LAYER_OF[src]:
            out.append(
                f"{imp.module}:{imp.line} imports {imp.imported}: {src} and {dst} are siblings"
            )
    return out


_JUMPS = (ast.Return, ast.Raise, ast.Continue, ast.Break)
_BLOCKS = ("body", "orelse", "finalbody", "handlers")


def unreachable(root: Path = PACKAGE_ROOT) -> list[str]:
    """``path:line`` of every statement that follows a return, raise, continue or break in the same
    block."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _BLOCKS:
                block = getattr(node, name, None)
                if not isinstance(block, list):
                    continue
                for before, after in zip(block, block[1:]):
                    if isinstance(before, _JUMPS):
                        kind = type(before).__name__.lower()
                        out.append(f"{path.relative_to(root.parent)}:{after.lineno}: unreachable after the "
                                   f"{kind} on line {before.lineno}")
                        break
    return out


def edges(imports: list[Import]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for imp in imports:
        if imp.source != imp.target and imp.source != "__init__":
            counts[(imp.source, imp.target)] = counts.get((imp.source, imp.target), 0) + 1
    return counts


def main(argv: list[str]) -> int:
    if argv == ["unreachable"]:
        dead = unreachable()
        print(f"{len(dead)} unreachable statement(s)")
        for line in dead:
            print("  " + line)
        return 1 if dead else 0
    if argv != ["imports"]:
        print("usage: python -m firsttoken.tools.devcheck imports|unreachable", file=sys.stderr)
        return 2
    imports = list(iter_imports())
    print("package imports (count), layer by layer, top to bottom:")
    for layer in LAYERS:
        for pkg in layer:
            targets = sorted((dst, n) for (src, dst), n in edges(imports).items() if src == pkg)
            if targets:
                print(f"  {pkg:10} -> " + ", ".join(f"{dst} ({n})" for dst, n in targets))
    bad = violations(imports)
    print(f"{len(bad)} import(s) pointing up or sideways")
    for line in bad:
        print("  " + line)
    circles = import_circles()
    print(f"{len(circles)} circle(s) of modules importing each other")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    return 1 if bad or circles else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
