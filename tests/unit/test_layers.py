"""The package's imports form layers that only point down (docs/architecture.md, "Layers")."""

from __future__ import annotations

from firsttoken.tools.devcheck import LAYER_OF, iter_imports, violations


def test_no_import_points_up_or_sideways():
    imports = list(iter_imports())
    assert len(imports) > 100  # the walk really saw the package
    assert violations(imports) == []


def test_the_check_catches_an_upward_import(tmp_path):
    pkg = tmp_path / "firsttoken"
    (pkg / "scheduler").mkdir(parents=True)
    (pkg / "scheduler" / "bad.py").write_text("def f():\n    from firsttoken.api.server import build_app\n")
    found = violations(list(iter_imports(pkg)))
    assert len(found) == 1 and "scheduler may not import api" in found[0]
    assert LAYER_OF["api"] < LAYER_OF["engine"] < LAYER_OF["scheduler"] < LAYER_OF["types"]
