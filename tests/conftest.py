"""Fixtures shared by every test directory, and the one way a test asks for a system program."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# Triton's CPU interpreter for the Triton kernels' unit tests (tests/unit/test_triton_attention.py). Triton reads
# TRITON_INTERPRET when it is first imported, and transformers' modeling modules import it (through torch._dynamo)
# while test modules are collected, so it is set here, before any test module; only where CUDA is absent (a GPU
# machine compiles the kernels and runs those tests on the device). Importing torch does not import triton.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from firsttoken.kernels.cpu_linear import set_kernel_threads
from firsttoken.models.checkpoint import make_model

# The recorded vLLM exchanges, inside the repository (see the README there for where they came from).
VLLM_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32"

# CI sets this to 1: a test whose system program is missing then fails instead of skipping, so CI cannot pass
# by skipping the dashboard and alert-rule tests.
REQUIRE_SYSTEM_TOOLS_ENV = "FIRSTTOKEN_REQUIRE_SYSTEM_TOOLS"


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis keeps its caches (the example database, a cache of each module's constants) in ./.hypothesis by
    default: the suite runs with -p no:cacheprovider and writes nothing into the checkout, so they live in the
    system's temporary directory instead (the fuzz tests use no example database at all)."""
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "firsttoken-hypothesis")


@pytest.fixture(autouse=True)
def _kernel_threads_follow_torch():
    """An engine stepped in the test's thread sets that thread's kernel threads (ThreadPlan): the next test starts
    with the default again (torch's count), as the kernel tests that vary torch's threads expect."""
    previous = set_kernel_threads(None)
    yield
    set_kernel_threads(previous)


@pytest.fixture
def torch_threads():
    """``torch_threads(n)`` sets torch's intra-op thread count for the test; the count before comes back after it."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2-VL checkpoint (seed 0, transformers layout), built once per session."""
    return make_model(tmp_path_factory.mktemp("tiny-seed0"), size="tiny", seed=0, layout="transformers")


def require_program(name: str, package: str, *aliases: str) -> str:
    """The path of system program `name` (or the first of `aliases` found on PATH). When none is found the calling
    test skips with the Debian package to install, or fails when $FIRSTTOKEN_REQUIRE_SYSTEM_TOOLS is 1."""
    for candidate in (name, *aliases):
        path = shutil.which(candidate)
        if path is not None:
            return path
    message = f"{name} is not on PATH; it comes with Debian's {package} package: apt-get install {package}"
    if os.environ.get(REQUIRE_SYSTEM_TOOLS_ENV) == "1":
        pytest.fail(f"{message}; {REQUIRE_SYSTEM_TOOLS_ENV}=1 requires it", pytrace=False)
    pytest.skip(message)
