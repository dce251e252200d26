"""What the benchmark scripts share: the `small` checkpoint and a `firsttoken serve` subprocess per configuration."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def small_model(model: str | None) -> str:
    """The given checkpoint, or the `small` random one built once into $FIRSTTOKEN_CACHE (default /tmp)."""
    if model is not None:
        return model
    from firsttoken.models.checkpoint import make_model

    path = Path(os.environ.get("FIRSTTOKEN_CACHE", "/tmp")) / "bench-small"
    if not (path / "config.json").exists():
        make_model(path, size="small")
    return str(path)


@contextmanager
def checkout(root: Path | None) -> Iterator[None]:
    """Servers started inside run ``root``'s firsttoken package (python -m puts the cwd first on sys.path, ahead
    of an editable install); a relative model path must be made absolute first. None: this checkout."""
    if root is None:
        yield
        return
    cwd, path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(root)
    os.environ["PYTHONPATH"] = str(root)
    try:
        yield
    finally:
        os.chdir(cwd)
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path


def start_server(model: str | Path, extra: list[str], timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`firsttoken serve` in its own process (as deployed), model id "m"; returns (process, base URL).
    $FIRSTTOKEN_BENCH_SERVE_ARGS adds flags to every server a benchmark starts (e.g. "--num-threads 1" when the
    benchmark is pinned to one core with `taskset -c 0`, so other work on the machine cannot stall its threads)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", str(model), "--port",
                             str(port), "--served-model-name", "m", "--log-level", "warning", *extra,
                             *shlex.split(os.environ.get("FIRSTTOKEN_BENCH_SERVE_ARGS", ""))])
    base = f"http://127.0.0.1:{port}"
    return proc, wait_healthy(proc, base, timeout_s, "server")


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, what: str, log_hint: str = "") -> str:
    """Poll ``base``/health until it answers 200 (returns ``base``); a process that exits or never gets there is a
    RuntimeError naming ``what`` (and ``log_hint``, e.g. where its log is), and the process is killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{log_hint}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not become healthy in {timeout_s:.0f} s{log_hint}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
