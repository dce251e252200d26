"""benchmarks/gpu/check_torch211.sh's Python half: what to install, which tests to run, and the summary.

    python benchmarks/gpu/torch211.py requirements OUT_TXT
    python benchmarks/gpu/torch211.py select RESULTS_DIR
    python benchmarks/gpu/torch211.py names RESULTS_DIR        (with the side environment's python)
    python benchmarks/gpu/torch211.py summarize RESULTS_DIR

``requirements``: pyproject's runtime and test dependencies with the GPU machine's own versions
(benchmarks/gpu/gpu-image.txt) in place of the project's pins, plus the wheels a GPU loan carries
(requirements-gpu.txt); the packages only tests off the CUDA path need (``OFF_PATH_PACKAGES``) are left out.

``select``: the CUDA path is every repository module that what a GPU loan runs (``tests/gpu/*.py`` and
``benchmarks/gpu/**/*.py``, this helper excepted) imports, transitively, lazy imports included (read from the source,
nothing imported). Its *device-facing* modules are those that import torch, triton, transformers or torchvision
themselves: the APIs this check is about. A test file belongs to the CUDA path's tests when it imports a device-facing
module directly; it is an *interpreter* test when it imports a module that imports triton, or a module importing
one, directly (the Triton kernels, their backend, their compile check). Writes RESULTS_DIR/selection.json (each test
file with the modules that put it there) and one test file a line to cuda_path_tests.txt (interpreter tests
excluded: they run in their own group) and interpreter_tests.txt.

``names``: every torch / triton / transformers / torchvision name the CUDA path's modules and the loan's own files
spell out (``torch.cuda.CUDAGraph``, ``tl.dot``, ``F.scaled_dot_product_attention``, ``from transformers import
Qwen2VLConfig``), looked up in the installed packages, and each keyword argument of a call to one checked against its
signature (torch's C functions: their ATen schemas): code that only a device runs (``torch.cuda.*``) is checked too,
which no CPU test reaches. Tensor methods (``x.pin_memory()``) are not: only running them checks those. The loan's own
files are then imported (tests/gpu's modules import without a device; its conftest only skips collecting them). RESULTS_DIR/names.json lists how many
names were checked and each one missing (module, line, name, why); exit 1 if any is.

``summarize``: RESULTS_DIR/summary.json from versions.json, steps.tsv (name, exit status, seconds, note, a line
each), names.json, each group's junit XML (passed / failed / skipped counts and the failures' node ids) and the
smoke run's own summary.json.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCAL_TOPS = ("firsttoken", "tests", "benchmarks")  # importable from REPO with PYTHONPATH=REPO
DEVICE_LIBRARIES = frozenset({"torch", "triton", "transformers", "torchvision"})
TEST_DIRS = ("tests/unit", "tests/engine", "tests/oracle", "tests/e2e")  # tests/gpu needs CUDA to be collected
# Test dependencies only of test files that import nothing device-facing (the OpenAPI schema fuzzer, lm-eval and
# LangChain as clients of the HTTP server): not installed in the side environment.
OFF_PATH_PACKAGES = frozenset({"schemathesis", "lm-eval", "langchain-openai"})
GROUPS = ("cuda_path", "interpreter")


@dataclass
class Source:
    """One Python file's imports: repository modules (each dotted prefix that is a module) and third-party tops."""
    local: set[str] = field(default_factory=set)
    third_party: set[str] = field(default_factory=set)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repo_modules() -> dict[str, Path]:
    return {module_name(p): p for top in LOCAL_TOPS for p in sorted((REPO / top).rglob("*.py"))}


def read_imports(path: Path, modules: dict[str, Path]) -> Source:
    """Every import statement of ``path`` (any depth: lazy imports count), resolved against ``modules``; ``from a.b
    import c`` counts ``a``, ``a.b`` and ``a.b.c`` where each is a module (importing a submodule runs its packages)."""
    out = Source()
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] not in LOCAL_TOPS:
                out.third_party.add(parts[0])
                continue
            out.local.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in modules)
    return out


def loan_roots() -> list[Path]:
    """What a GPU loan runs: the CUDA-only tests and everything under benchmarks/gpu (run.sh's steps)."""
    here = Path(__file__).resolve()
    roots = sorted((REPO / "tests" / "gpu").glob("*.py")) + sorted((REPO / "benchmarks" / "gpu").rglob("*.py"))
    return [p for p in roots if p != here]


def select() -> dict:
    modules = repo_modules()
    sources = {name: read_imports(path, modules) for name, path in modules.items()}
    path_modules: set[str] = set()
    stack = [m for root in loan_roots() for m in sources[module_name(root)].local]
    while stack:
        name = stack.pop()
        if name not in path_modules:
            path_modules.add(name)
            stack.extend(sources[name].local)
    device_facing = {m for m in path_modules if sources[m].third_party & DEVICE_LIBRARIES}
    triton_modules = {m for m, s in sources.items() if "triton" in s.third_party and m.startswith("firsttoken.")}
    kernel_modules = triton_modules | {m for m, s in sources.items()
                                       if m.startswith("firsttoken.") and s.local & triton_modules}
    tests: dict[str, list[str]] = {}
    interpreter: list[str] = []
    for test_dir in TEST_DIRS:
        for path in sorted((REPO / test_dir).glob("test_*.py")):
            imported = sources[module_name(path)].local
            rel = str(path.relative_to(REPO))
            if imported & device_facing:
                tests[rel] = sorted(imported & device_facing)
            if imported & kernel_modules:
                interpreter.append(rel)
    return {
        "roots": [str(p.relative_to(REPO)) for p in loan_roots()],
        "cuda_path_modules": sorted(m for m in path_modules if m.startswith("firsttoken")),
        "device_facing_modules": sorted(m for m in device_facing if m.startswith("firsttoken")),
        "kernel_modules": sorted(kernel_modules),
        "test_files": tests,
        "interpreter_tests": interpreter,
    }


def write_selection(results: Path) -> None:
    chosen = select()
    (results / "selection.json").write_text(json.dumps(chosen, indent=2) + "\n")
    cuda_path = [t for t in chosen["test_files"] if t not in chosen["interpreter_tests"]]
    (results / "cuda_path_tests.txt").write_text("".join(f"{t}\n" for t in cuda_path))
    (results / "interpreter_tests.txt").write_text("".join(f"{t}\n" for t in chosen["interpreter_tests"]))
    print(f"torch211: {len(chosen['cuda_path_modules'])} modules on the CUDA path, "
          f"{len(chosen['device_facing_modules'])} device-facing; {len(cuda_path)} test files import them, "
          f"{len(chosen['interpreter_tests'])} more run the Triton kernels under the interpreter")


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements() -> list[str]:
    pins = [line.strip() for line in (REPO / "benchmarks/gpu/gpu-image.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    pinned = {_name(p) for p in pins}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    carried = [line.split("#")[0].strip() for line in
               (REPO / "benchmarks/gpu/requirements-gpu.txt").read_text().splitlines()]
    out = list(pins)
    for req in wanted + [c for c in carried if c]:
        name = _name(req)
        if name not in pinned and name not in OFF_PATH_PACKAGES:
            out.append(req)
    return out


@dataclass(frozen=True)
class NameUse:
    """A dotted name of a device library used in a module: ``torch.cuda.graph`` called with ``pool=``."""
    module: str
    line: int
    dotted: str
    keywords: tuple[str, ...]


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name for each import of a device library (``F`` -> ``torch.nn.functional``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in DEVICE_LIBRARIES:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in DEVICE_LIBRARIES:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def name_uses(module: str, path: Path) -> list[NameUse]:
    """Each outermost dotted name rooted at a device library's alias (``torch.cuda.graph``, not also ``torch.cuda``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _aliases(tree)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    uses = set()
    for node in ast.walk(tree):
        if id(node) in inner or not isinstance(node, (ast.Attribute, ast.Name)):
            continue
        chain = _dotted(node)
        if chain and chain[0] in aliases:
            call = calls.get(id(node))
            keywords = tuple(k.arg for k in call.keywords if k.arg) if call else ()
            uses.add(NameUse(module, node.lineno, ".".join([aliases[chain[0]], *chain[1:]]), keywords))
    return sorted(uses, key=lambda u: (u.line, u.dotted))


def resolve(dotted: str) -> tuple[object | None, str]:
    """The object a dotted name names, importing its longest importable module prefix; (None, why) if missing."""
    import importlib

    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        return None, f"cannot import {parts[0]}"
    for j in range(i, len(parts)):
        if not hasattr(obj, parts[j]):
            return None, f"{'.'.join(parts[:j])} has no attribute {parts[j]!r}"
        obj = getattr(obj, parts[j])
    return obj, ""


def keyword_names(obj: object) -> set[str] | None:
    """The keywords a callable takes: its signature's, else (torch's C builtins) every argument of its ATen schemas;
    None when that cannot be known (``**kwargs``, no signature and no schema)."""
    import inspect

    try:
        params = inspect.signature(obj).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        import torch

        name = getattr(obj, "__name__", "")
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}") if name else []
        return {a.name for schema in schemas for a in schema.arguments} or None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def missing_names(sources: dict[str, Path]) -> tuple[int, list[dict]]:
    """(how many uses were looked up, each missing one) over ``sources`` (module name -> file)."""
    missing, checked = [], 0
    for module, path in sources.items():
        for use in name_uses(module, path):
            checked += 1
            obj, why = resolve(use.dotted)
            accepted = keyword_names(obj) if obj is not None and use.keywords else None
            unknown = sorted(set(use.keywords) - accepted) if accepted is not None else []
            if unknown:
                why = f"{use.dotted}() takes no keyword {', '.join(unknown)}"
            if why:
                missing.append({"module": module, "line": use.line, "name": use.dotted, "why": why})
    return checked, missing


def import_errors(modules: list[str]) -> dict[str, str]:
    """Each module that fails to import here, with its error (tests/gpu's modules import without a device)."""
    import importlib

    errors = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any error at import is the finding
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def check_names(results: Path) -> int:
    """The CUDA path's modules and the loan's own files (tests/gpu, benchmarks/gpu), which are imported too."""
    chosen = json.loads((results / "selection.json").read_text())
    modules = repo_modules()
    roots = [module_name(REPO / root) for root in chosen["roots"]]
    checked, missing = missing_names({name: modules[name] for name in chosen["cuda_path_modules"] + roots})
    errors = import_errors(roots)
    (results / "names.json").write_text(
        json.dumps({"checked": checked, "missing": missing, "imported": len(roots), "import_errors": errors},
                   indent=2) + "\n")
    print(f"torch211: {checked} uses of torch / triton / transformers / torchvision names on the CUDA path, "
          f"{len(missing)} missing here; {len(roots)} loan files imported, {len(errors)} failed")
    for m in missing:
        print(f"    {m['module']}:{m['line']}: {m['why']}")
    for name, error in errors.items():
        print(f"    import {name}: {error}")
    return 1 if missing or errors else 0


@dataclass
class GroupResult:
    passed: int = 0
    failed: list[str] = field(default_factory=list)  # node ids, errors included
    skipped: int = 0


def read_junit(path: Path) -> GroupResult:
    """Counts and failing node ids from pytest's xunit1 XML (its testcases carry ``file``)."""
    result = GroupResult()
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file", "")
        module = file.removesuffix(".py").replace("/", ".")
        classes = case.get("classname", "").removeprefix(module).strip(".")
        name = case.get("name", "")
        node_id = file if name == module else "::".join([file, *(classes.split(".") if classes else []), name])
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            result.failed.append(node_id)
        elif "skipped" in outcome:
            result.skipped += 1
        else:
            result.passed += 1
    return result


def summarize(results: Path) -> dict:
    steps = []
    for line in (results / "steps.tsv").read_text().splitlines():
        name, rc, seconds, note = line.split("\t", 3)
        steps.append({"step": name, "rc": int(rc), "seconds": float(seconds), "note": note})
    summary: dict = {"versions": json.loads((results / "versions.json").read_text()), "steps": steps, "groups": {}}
    for group in GROUPS:
        xml = results / f"{group}.xml"
        if xml.exists():
            r = read_junit(xml)
            summary["groups"][group] = {"passed": r.passed, "failed": len(r.failed), "skipped": r.skipped,
                                        "failures": r.failed}
        else:
            summary["groups"][group] = {"not_run": "no junit XML (pytest did not start or was killed)"}
    names = results / "names.json"
    summary["names"] = json.loads(names.read_text()) if names.exists() else None
    smoke = results / "smoke" / "summary.json"
    smoke_notes = [s["note"] for s in steps if s["step"] == "smoke"]  # "run.sh --smoke: not in this checkout"
    summary["smoke"] = json.loads(smoke.read_text()) if smoke.exists() else (smoke_notes or [None])[0]
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "requirements":
        Path(argv[1]).write_text("".join(f"{r}\n" for r in requirements()))
    elif len(argv) == 2 and argv[0] == "select":
        write_selection(Path(argv[1]))
    elif len(argv) == 2 and argv[0] == "names":
        return check_names(Path(argv[1]))
    elif len(argv) == 2 and argv[0] == "summarize":
        summary = summarize(Path(argv[1]))
        if summary["names"] is not None:
            names = summary["names"]
            print(f"torch211: names: {names['checked']} checked, {len(names['missing'])} missing; "
                  f"{names['imported']} loan files imported, {len(names['import_errors'])} failed")
        for group, counts in summary["groups"].items():
            print(f"torch211: {group}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "failures"))
            for node_id in counts.get("failures", []):
                print(f"    FAILED {node_id}")
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
