"""The suite's one way to ask for a system program (chromium, promtool): a missing program skips with the Debian
package to install, or fails when CI sets FIRSTTOKEN_REQUIRE_SYSTEM_TOOLS=1; a present one is its path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_SYSTEM_TOOLS_ENV, require_program

MISSING = "firsttoken-no-such-program"


def test_missing_program_skips_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_SYSTEM_TOOLS_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install firsttoken-pkg") as skipped:
        require_program(MISSING, "firsttoken-pkg")
    assert MISSING in str(skipped.value)


def test_missing_program_fails_when_ci_requires_system_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_SYSTEM_TOOLS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"apt-get install firsttoken-pkg.*{REQUIRE_SYSTEM_TOOLS_ENV}=1"):
        require_program(MISSING, "firsttoken-pkg", "firsttoken-no-such-alias")


def test_present_program_or_alias_is_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_SYSTEM_TOOLS_ENV, "1")
    python = Path(sys.executable)
    monkeypatch.setenv("PATH", str(python.parent))
    assert Path(require_program(python.name, "python3")).name == python.name
    assert Path(require_program(MISSING, "python3", python.name)).name == python.name
