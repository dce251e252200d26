"""llama.cpp as a side-by-side peer: build it from PyPI's source package, convert a firsttoken checkpoint to GGUF,
start ``llama-server``. Nothing here runs in CI: benchmarks only.

Work directory layout (``--work-dir``; everything is reused when already there):

    dl/llama_cpp_python-0.3.36.tar.gz     the sdist; its vendor/llama.cpp is the source (commit 0c1e570)
    src -> llama_cpp_python-0.3.36/vendor/llama.cpp
    build/bin/llama-server                CPU, Release, -march=native, no web UI, no OpenSSL
    small-orig/                           firsttoken make-model --size small --layout original
    gguf/qwen2vl-small-{f32,q8_0}.gguf, gguf/mmproj-qwen2vl-small-f32.gguf

The converter runs in its own venv (transformers 4.57.x, as llama.cpp's converter expects; firsttoken pins 5.x),
made with --system-site-packages so it reuses the installed CPU torch instead of downloading a CUDA build.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import wait_healthy  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # the UI download fails offline
    "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
)  # fmt: skip
CONVERTER_REQUIREMENTS = ("transformers==4.57.6", "protobuf>=4.21.0,<5.0.0", "sentencepiece", "safetensors", "numpy")
SHIM = Path(__file__).resolve().parent / "llamacpp_convert.py"
NICE = ("nice", "-n", "10")  # builds and conversions yield to timing-sensitive work on a shared machine


@dataclass(frozen=True)
class LlamaCppTree:
    """A llama.cpp work directory: ``src/`` (the source tree) and ``build/bin/llama-server``."""

    root: Path

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    def commit(self) -> str | None:
        out = subprocess.run(["git", "-C", str(self.src), "log", "--format=%h", "-1"], capture_output=True, text=True,
                             check=False)  # fmt: skip
        return (out.stdout.strip() or None) if out.returncode == 0 else None


@dataclass(frozen=True)
class GGUFPair:
    model: Path  # the language model (+ tokenizer, chat template)
    mmproj: Path  # the vision tower and merger


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def build(tree: LlamaCppTree, jobs: int = 2) -> None:
    """Download the sdist (the only network use: PyPI), unpack it, build llama-server. Skips what exists."""
    root = tree.root
    root.mkdir(parents=True, exist_ok=True)
    if not tree.src.exists():
        archive = root / "dl" / f"{SDIST}.tar.gz"
        if not archive.exists():
            # the sdist of this package only: ":all:" would build every build dependency from source too
            _run([*NICE, sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                  LLAMA_CPP_PYTHON, "-d", str(archive.parent)])  # fmt: skip
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        tree.src.symlink_to(root / SDIST / "vendor" / "llama.cpp")
    if not tree.server.exists():
        build_dir = root / "build"
        _run([*NICE, "cmake", "-S", str(tree.src), "-B", str(build_dir), *CMAKE_FLAGS])
        _run([*NICE, "cmake", "--build", str(build_dir), "--config", "Release", f"-j{jobs}", "--target",
              "llama-server"])  # fmt: skip


def converter_python(tree: LlamaCppTree, venv: Path) -> Path:
    """The converter venv's python, created on first use."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([*NICE, sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
        _run([*NICE, str(python), "-m", "pip", "install", "-q", *CONVERTER_REQUIREMENTS, "-e",
              str(tree.src / "gguf-py")])  # fmt: skip
    return python


def small_checkpoint(path: Path) -> Path:
    """Our `small` random checkpoint in the original Qwen layout (same seed = same weights as the default)."""
    if not (path / "config.json").exists():
        from firsttoken.models.checkpoint import make_model

        make_model(path, size="small", layout="original")
    return path


def convert(tree: LlamaCppTree, python: Path, model_dir: Path, out_dir: Path, outtype: str) -> GGUFPair:
    """GGUFs of model_dir's language model (``outtype``: f32, q8_0, ...) and its f32 vision projector."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = GGUFPair(out_dir / f"qwen2vl-{model_dir.name}-{outtype}.gguf", out_dir / f"mmproj-{model_dir.name}-f32.gguf")
    jobs = ((pair.model, ["--outtype", outtype]), (pair.mmproj, ["--mmproj", "--outtype", "f32"]))
    for out, flags in jobs:
        if not out.exists():
            _run([*NICE, str(python), str(SHIM), str(tree.src), str(model_dir), *flags, "--outfile", str(out)])
    return pair


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(
    server: Path, gguf: GGUFPair, *, threads: int, parallel: int, ctx_len: int, timeout_s: float = 120.0,
    extra_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """llama-server on a free port with /metrics on and its host-memory prompt cache off (-cram 0);
    returns (process, base URL) once /health answers 200. Its log goes to a file beside the GGUF."""
    port = free_port()
    cmd = [str(server), "-m", str(gguf.model), "--mmproj", str(gguf.mmproj), "--host", "127.0.0.1", "--port",
           str(port), "-t", str(threads), "-tb", str(threads), "-c", str(ctx_len), "-np", str(parallel),
           "-cram", "0", "--metrics", *extra_args]  # fmt: skip
    log = open(gguf.model.with_suffix(f".np{parallel}.log"), "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    return proc, wait_healthy(proc, base, timeout_s, "llama-server", f": see {log.name}")
