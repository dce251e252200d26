"""The package's imports form layers that only point down (docs/architecture.md, "Layers"), and no modules import
each other in a circle."""

from __future__ import annotations

from firsttoken.tools.devcheck import LAYER_OF, import_circles, iter_imports, unreachable, violations


def test_no_import_points_up_or_sideways():
    imports = list(iter_imports())
    assert len(imports) > 100  # the walk really saw the package
    assert violations(imports) == []


def test_no_model_module_imports_the_kernels():
    # model code calls its layers; which kernel a layer runs is chosen once in loading/ (STYLE rule 26)
    assert [f"{i.module}:{i.line}" for i in iter_imports() if i.source == "models" and i.target == "kernels"] == []


def test_the_check_catches_an_upward_import(tmp_path):
    pkg = tmp_path / "firsttoken"
    (pkg / "scheduler").mkdir(parents=True)
    (pkg / "scheduler" / "bad.py").write_text("def f():\n    from firsttoken.api.server import build_app\n")
    found = violations(list(iter_imports(pkg)))
    assert len(found) == 1 and "scheduler may not import api" in found[0]
    assert LAYER_OF["api"] < LAYER_OF["engine"] < LAYER_OF["scheduler"] < LAYER_OF["types"]


def test_no_modules_import_each_other_in_a_circle():
    assert import_circles() == []


def test_the_check_finds_a_circle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "firsttoken"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "main.py").write_text("from firsttoken.cli import simulate\n")
    (pkg / "cli" / "simulate.py").write_text("def f():\n    from firsttoken.cli.main import build_parser\n")
    (pkg / "cli" / "plan.py").write_text("from firsttoken.cli import main\n")
    assert import_circles(pkg) == [("firsttoken.cli.main", "firsttoken.cli.simulate")]


def test_no_statement_in_the_package_is_unreachable():
    assert unreachable() == []


def test_the_check_finds_a_statement_after_a_return(tmp_path):
    pkg = tmp_path / "firsttoken"
    pkg.mkdir()
    (pkg / "config.py").write_text(
        "def f(x):\n    if x:\n        raise ValueError\n    return 1\n    check(x)\n"
        "def g(xs):\n    for x in xs:\n        continue\n        print(x)\n    return 2\n"
    )
    assert unreachable(pkg) == [
        "firsttoken/config.py:5: unreachable after the return on line 4",
        "firsttoken/config.py:9: unreachable after the continue on line 8",
    ]
