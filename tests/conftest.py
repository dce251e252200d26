"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from firsttoken.models.checkpoint import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2-VL checkpoint (seed 0, transformers layout), built once per session."""
    return make_model(tmp_path_factory.mktemp("tiny-seed0"), size="tiny", seed=0, layout="transformers")


# The recorded vLLM exchanges live in shared/, beside the repository (in sessions and in CI alike).
VLLM_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "vllm-0.32"
