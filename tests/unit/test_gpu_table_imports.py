"""The GPU table's steps can import everything on the GPU machine: each third-party module that the table's code
imports is either in that machine's image (benchmarks/gpu/image-packages.txt) or listed in
benchmarks/gpu/requirements-gpu.txt (which fetch_wheels.sh downloads, dependencies included, and run.sh installs
there, with no network); and fetch_wheels.sh refuses, in one line, a carried tree over the device tool's limit.

The walk: from the scripts run.sh runs (benchmarks/gpu/*.py and steps/*.py) and the server's entry point, every
module-level import of a repository module is followed, and the function-level ones of the files on the table's
path (``FUNCTIONS_RUN``); a third-party module counts where a reached module imports it at module level, or in a
function of those files. A third-party import inside any other function is lazy by design (PyAV for video, which the
table leaves out); the smoke run (tests/e2e/test_gpu_table_smoke.py) runs the path the table takes."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
# What run.sh runs, and the server the served step starts (`python -m firsttoken.cli.main serve`).
ENTRIES = sorted([*GPU.glob("*.py"), *(GPU / "steps").glob("*.py"), ROOT / "firsttoken" / "cli" / "main.py"])
# Where the table's path goes through function-level imports: the table's own code, the server's start-up
# (cli/serve.py imports the app inside its functions) and the offline engine (llm.py).
FUNCTIONS_RUN = (GPU, ROOT / "firsttoken" / "cli" / "serve.py", ROOT / "firsttoken" / "llm.py")
SEARCH = [GPU, GPU.parent, ROOT]  # step.py's sys.path, first match wins


def module_file(name: str) -> Path | None:
    """The repository file that `import name` loads under step.py's sys.path, or None (not ours)."""
    parts = name.split(".")
    for base in SEARCH:
        path = base.joinpath(*parts)
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module name, at module level) for every import in ``path``, TYPE_CHECKING blocks left out; a
    `from package import name` yields both `package` and `package.name` (a submodule when such a file exists)."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, top))
                found.extend((f"{child.module}.{alias.name}", top) for alias in child.names)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not nested)

    visit(tree, True)
    return found


def third_party_imports() -> dict[str, set[str]]:
    """Third-party top-level module -> the repository files that import it (see the module's docstring)."""
    seen: set[Path] = set()
    todo = list(ENTRIES)
    used: dict[str, set[str]] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        ours = any(path == p or p in path.parents for p in FUNCTIONS_RUN)  # its function-level imports run
        for name, top in imports(path):
            target = module_file(name)
            if target is not None:
                if top or ours:
                    todo.append(target)
                continue
            root = name.split(".")[0]
            if module_file(root) is not None or root in sys.stdlib_module_names:
                continue  # a name inside one of our packages, or the standard library
            if top or ours:
                used.setdefault(root, set()).add(str(path.relative_to(ROOT)))
    return used


def canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def listed(path: Path) -> set[str]:
    """Distribution names of a requirements-style file (comments, blank lines and version pins dropped)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonical(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]))
    return names


def test_every_third_party_import_of_the_table_is_on_the_gpu_machine_or_carried() -> None:
    image, carried = listed(GPU / "image-packages.txt"), listed(GPU / "requirements-gpu.txt")
    dists = packages_distributions()
    used = third_party_imports()
    assert {"torch", "transformers", "fastapi"} <= set(used)  # the walk reaches the engine and the server
    missing = {}
    for module, where in sorted(used.items()):
        names = {canonical(d) for d in dists.get(module, [])}
        assert names, f"{module} (imported by {sorted(where)}) is not installed here: its distribution is unknown"
        if not names & (image | carried):
            missing[module] = (sorted(names), sorted(where)[:3])
    assert not missing, f"add to benchmarks/gpu/requirements-gpu.txt (not on the GPU image): {missing}"


def test_the_table_does_not_need_pyav() -> None:
    """Video stays out of the loan: PyAV's wheel alone is 36 MB of the 64 MiB the device tool carries."""
    assert "av" not in third_party_imports()


def test_fetch_wheels_refuses_a_carried_tree_over_the_limit_in_one_line(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "big.whl").write_bytes(os.urandom(3 * 2**20))
    script = GPU / "fetch_wheels.sh"
    fits = subprocess.run(["bash", str(script), "--check", str(wheels)], capture_output=True, text=True, timeout=60)
    assert fits.returncode == 0, fits.stderr
    assert re.search(r"repository [\d.]+ MiB \+ .* 3\.0 MiB = [\d.]+ MiB, within 64 MiB", fits.stdout)
    over = subprocess.run(["bash", str(script), "--check", str(wheels)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CARRY_LIMIT_MIB": "1"})
    assert over.returncode == 3
    assert over.stdout == "" and len(over.stderr.strip().splitlines()) == 1
    assert "over the 1 MiB limit" in over.stderr
