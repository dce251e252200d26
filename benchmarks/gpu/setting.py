"""What the GPU table's steps share: the run's setting (a device run, or --smoke with the CPU standing in), the
checkpoints it measures, the engine it builds, device-synchronized timing and the gate's verdict.

A device run measures the published Qwen2-VL-7B-Instruct and Qwen2.5-VL-7B-Instruct shapes with dummy weights
(``--load-format dummy``: drawn on the device, nothing written to disk) in bf16. ``--smoke`` runs every step's code
path on the CPU with each family's tiny random checkpoint (also served with dummy weights), fp32 timing, small
images and few repeats: its figures mean nothing, its keys are the device run's keys. Where the CPU cannot do what
the device run does (the Triton backend and CUDA graphs are cuda-only), the smoke run uses the SDPA backend and no
graphs in their place and each step's JSON says so under ``stand_ins``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from firsttoken.inputs.budget import REFERENCE_MAX_TOKENS
from firsttoken.llm import LLM
from firsttoken.models.checkpoint import make_dummy_model, make_model
from manifest import backend_verdict
from tests.published_configs import QWEN2_VL_7B_INSTRUCT, QWEN25_VL_7B_INSTRUCT

T = TypeVar("T")
DTYPES = {"bf16": ("bfloat16", torch.bfloat16), "fp32": ("float32", torch.float32)}  # manifest name -> LLM, torch
PUBLISHED = {"qwen2-vl": QWEN2_VL_7B_INSTRUCT, "qwen2.5-vl": QWEN25_VL_7B_INSTRUCT}  # the 7B shapes a device runs
GATE_FAMILY = "qwen2-vl"  # the benchmark shape the gate checks: Qwen2-VL-7B
MODELS_DIR_ENV = "FIRSTTOKEN_GPU_TABLE_MODELS"  # where checkpoint directories are made (default: the temp dir)


@dataclass(frozen=True)
class Setting:
    smoke: bool
    device: str  # "cuda" | "cpu"
    timing_dtype: str  # manifest dtype of the timing steps: "bf16" on a device, "fp32" in --smoke
    text_words: int  # the seed mix's ~800 tokens of text (bench's English words: about 1.6 tokens each here)
    text_tokens: int  # the same as random token ids (the MFU step's prompt)
    image_side_px: int  # square images of this side
    gate_new_tokens: int  # greedy tokens compared per gate prompt
    repeats: int  # timed runs after one warm-up (medians over these)
    decode_new_tokens: int
    kv_cache_memory: str  # given, so no engine sizes its pool from (and takes) 90% of the device
    served_requests: int
    served_output_tokens: int
    served_probes: int  # each class's requests sent alone, to measure its service time and unloaded TTFT
    matmul_side: int  # the peak's square matmul
    copy_bytes: int  # the copy-bandwidth probe's tensor

    @classmethod
    def for_run(cls, smoke: bool) -> Setting:
        if smoke:
            return cls(smoke=True, device="cpu", timing_dtype="fp32", text_words=48, text_tokens=80, image_side_px=112,
                       gate_new_tokens=6, repeats=1, decode_new_tokens=6, kv_cache_memory="64MiB",
                       served_requests=8, served_output_tokens=3, served_probes=1, matmul_side=256,
                       copy_bytes=16 * 2**20)  # fmt: skip
        return cls(smoke=False, device="cuda", timing_dtype="bf16", text_words=512, text_tokens=800, image_side_px=1024,
                   gate_new_tokens=16, repeats=3, decode_new_tokens=64, kv_cache_memory="2GiB",
                   served_requests=40, served_output_tokens=8, served_probes=2, matmul_side=8192,
                   copy_bytes=2 * 2**30)  # fmt: skip

    # ---- what runs ----------------------------------------------------------------------------------------------
    def backend(self, name: str) -> str:
        """The attention backend that stands for ``name`` here: itself on a device; sdpa on the CPU (triton is
        cuda-only)."""
        return name if self.device == "cuda" else "sdpa"

    def cuda_graphs(self, flag: str) -> str:
        return flag if self.device == "cuda" else "off"

    def threads(self) -> None:
        """One torch thread in --smoke (its tiny shapes gain nothing from more, and on a shared 2-core machine two
        threads stall each other); a device run leaves torch's default."""
        if self.smoke:
            torch.set_num_threads(1)

    def stand_ins(self) -> dict[str, str]:
        """What this run measures in place of what a device run does (empty on a device)."""
        if not self.smoke:
            return {}
        return {"device": "cpu (no CUDA here)", "triton": "sdpa (the Triton backend is cuda-only)",
                "cuda_graphs": "off (cuda-only)", "shapes": "each family's tiny checkpoint, not the 7B shapes",
                "bf16 timing": "fp32", "threads": "one torch thread"}  # fmt: skip

    def shape_name(self, family: str) -> str:
        return f"{family} tiny (random)" if self.smoke else f"{family} 7B-Instruct config, dummy weights"

    def model_dir(self, family: str) -> Path:
        """The checkpoint directory of ``family``'s measured shape, made once (served with --load-format dummy)."""
        root = Path(os.environ.get(MODELS_DIR_ENV) or Path(tempfile.gettempdir()) / "firsttoken-gpu-table")
        target = root / (f"{family}-tiny" if self.smoke else f"{family}-7b-dummy")
        if (target / "config.json").exists():
            return target
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        if self.smoke:
            make_model(tmp, size="tiny", seed=0, family=family)
        else:
            make_dummy_model(tmp, PUBLISHED[family])
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def llm(self, model_dir: Path, dtype: str, backend: str, **options: Any) -> LLM:
        """The engine on this run's device with dummy weights, images not lowered (``image_max_tokens`` 16384: a
        1024x1024 image is its 1,369 visual tokens, as transformers' processor makes it)."""
        # the CPU: weights stay plain tensors (the gate's views), one thread (a shared 2-core machine stalls on two)
        extra = {"cpu_kernels": "off", "num_threads": 1} if self.device == "cpu" else {}
        options = {"image_max_tokens": REFERENCE_MAX_TOKENS, "kv_cache_memory": self.kv_cache_memory, **extra,
                   **options}
        return LLM(model_dir, device=self.device, dtype=DTYPES[dtype][0], load_format="dummy",
                   attention_backend=self.backend(backend), **options)

    # ---- timing -------------------------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], T]) -> tuple[T, float]:
        """(fn's result, wall seconds) with the device's queued work finished on both sides."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start

    def free(self) -> dict[str, float]:
        """Give back what dropped references held (the next engine of a 7B shape needs the room); returns the
        device memory still allocated and reserved, GiB (empty on the CPU), for the step's context."""
        gc.collect()
        if self.device != "cuda":
            return {}
        torch.cuda.empty_cache()
        return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def median(values: list[float]) -> float:
    return statistics.median(values)


def model_of(llm: LLM) -> torch.nn.Module:
    """The engine's model (its weights on the device)."""
    return llm.engine.executor.runner.model


def gate_verdict(results_dir: Path, backend: str) -> tuple[bool, str]:
    """(whether timing with ``backend`` may run, why not): the gate must have checked it in full and passed it
    (manifest.backend_verdict), whether or not the gate step itself finished."""
    path = results_dir / "gate.json"
    if not path.exists():
        return False, "skipped: the gate did not run (no gate.json)"
    ok, why = backend_verdict(json.loads(path.read_text())["values"], backend)
    return ok, "" if ok else f"skipped: {why}"
