"""Load a checkpoint (safetensors, single file or sharded) into its family's model.

The family says how checkpoint names map onto our parameters (models/weights.py: prefixes, stacked projections,
reshapes); this module only reads files. Tensors are read one at a time and cast straight to the target dtype, so a
bf16 load never holds an fp32 copy of the model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from firsttoken.attention.base import AttentionBackend
from firsttoken.attention.registry import get_backend
from firsttoken.config import CPU_KERNELS, FLOAT32_ACTIVATIONS, QUANTIZATIONS
from firsttoken.kernels.cpu_linear import (
    cpu_has_avx512,
    kernel_unavailable,
    kernels_skipped,
    use_few_rows_kernel,
)
from firsttoken.models.fused_decode import use_fused_decode
from firsttoken.models.layers import store_weights_input_major
from firsttoken.models.quant import int8_paths, quantize_bf16, quantize_fp16, quantize_int8
from firsttoken.models.registry import family_of, load_model_config

log = logging.getLogger("firsttoken.models")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend | None = None,
    quantization: str = "none",
    num_threads: int | None = None,
    cpu_kernels: str = "auto",
) -> nn.Module:
    """The family's model in eval mode with weights from model_dir; attn_backend defaults to "sdpa";
    ``quantization`` one of models/quant.py's QUANTIZATIONS ("fp16": the language model's linear layers hold float16
    weights, float32 activations; ``num_threads`` 1: the engine runs on one torch thread, so its single-threaded
    kernel, cheaper per call, is taken; "int8": the linear layers of both the language model and the vision tower
    hold per-row int8 weights, inputs quantized per call; "bf16": the language model's linear layers hold bfloat16
    weights, float32 activations; "auto": ``auto_quantization``'s choice). ``cpu_kernels`` ("auto", "on", "off";
    kernels/cpu_linear.py's ``kernels_skipped``): whether a float32 language model on the CPU takes the few-rows
    kernels for decode steps (prefill is MKL's either way)."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
    if quantization in FLOAT32_ACTIVATIONS and dtype != torch.float32:
        raise ValueError(f"--quantization {quantization} runs float32 activations: use --dtype float32 (or auto)")
    model_dir = Path(model_dir)
    if quantization == "auto":
        quantization, why = auto_quantization(model_dir, dtype, device, cpu_kernels)
        log.info("--quantization auto: %s (%s)", quantization, why)
    family = family_of(model_dir)
    config = load_model_config(model_dir)
    with torch.device("meta"):
        model = family.build(config, attn_backend or get_backend("sdpa"))
    expected = {name: p.shape for name, p in model.named_parameters()}

    def tensors() -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        for file in _safetensors_files(model_dir):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, lambda key=key, f=f: f.get_tensor(key).to(device=device, dtype=dtype)

    tied = config.tie_word_embeddings  # tied: the reference uses embed_tokens, any lm_head tensor is ignored
    state, unexpected = family.weights.load_state(tensors(), expected, drop=lambda n: tied and n.startswith("lm_head."))
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match {type(model).__name__}: "
            f"missing {len(missing)} {missing[:8]}, unexpected {len(unexpected)} {unexpected[:8]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name]:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(expected[name])}")
    model.load_state_dict(state, strict=True, assign=True)
    del state  # the model holds the only reference now: a re-laid-out weight frees its original at once
    model.requires_grad_(False)
    kernels_off = _kernels_off(cpu_kernels)  # why int8 or bf16 weights would go without the kernels, or None
    if quantization == "fp16":
        quantize_fp16(model, exclude_prefix="visual.", multithreaded=num_threads != 1)
    elif quantization == "int8":  # the vision tower too: its encode is most of an image request's TTFT
        quantize_int8(model, use_kernels=kernels_off is None)
        log.info("int8 products: %s", int8_paths(kernels_off))
    elif quantization == "bf16":  # decode reads half the bytes; the fused layers take bf16 weights beside float32
        quantize_bf16(model, exclude_prefix="visual.", use_kernels=kernels_off is None)
        log.info("bf16 weights: decode steps' products %s", "by firsttoken's kernels" if kernels_off is None
                 else f"widened for torch's ({kernels_off})")
    if str(device) == "cpu":
        # why a pure-decode step's decoder layers would not run as one call (None: try it)
        if quantization != "none":
            unfused = {"fp16": "float16 weights (FBGEMM)", "int8": kernels_off, "bf16": kernels_off}[quantization]
        elif dtype in (torch.float32, torch.bfloat16):
            unfused = kernels_skipped(cpu_kernels, dtype)
        else:
            unfused = f"{str(dtype).removeprefix('torch.')} weights"
        if not keeps_row_major(quantization, unfused):
            store_weights_input_major(model, exclude_prefix="visual.")  # MKL's one-row products at decode
        if quantization == "none":
            if unfused is None:
                use_few_rows_kernel(model, exclude_prefix="visual.")  # decode's few-row products; prefill: MKL's
            log.info("decode steps' products: %s", "firsttoken's few-rows AVX2 kernels" if unfused is None
                     else f"torch's (few-rows kernels not used: {unfused})")
        if unfused is None:
            unfused = use_fused_decode(model)
        log.info("decode steps' decoder layers: %s", "one fused call" if unfused is None else f"eager ({unfused})")
    model.quantization = quantization  # what was applied (auto resolved): the engine's start-up log reads it
    return model.eval()


def keeps_row_major(quantization: str, kernels_skipped_why: str | None) -> bool:
    """Whether a float32 language model keeps its checkpoint's row-major weights instead of storing the widening
    ones input-major (``store_weights_input_major``): where firsttoken's kernels take its decode products on a CPU
    without AVX-512. There the row-major loop streams each output's weights as one run and beat the AVX2
    input-major loop (2-vCPU AVX2 EPYC, `small`, whole float32 decode steps in process, 8 rounds alternating: batch 1
    0.90x, batch 8 0.76x the time; an 805-token prefill through MKL 1.08x, rounds overlapping; MKL's products alone
    1.00-1.04x at 64-800 rows). AVX-512 CPUs keep input-major (its 16-wide loop, im_range16, was measured there;
    row-major was not), and so do MKL's decode products (its one-row path is faster input-major)."""
    return quantization == "none" and kernels_skipped_why is None and not cpu_has_avx512()


def auto_quantization(model_dir: Path, dtype: torch.dtype, device: torch.device | str, cpu_kernels: str
                      ) -> tuple[str, str]:
    """What ``--quantization auto`` applies, and why: "bf16" where the checkpoint stores its language model's
    linear weights in bf16 and the model runs float32 activations on the CPU with firsttoken's kernels (those
    weights at their own bytes: decode steps read half of float32's; the same values, so float32 inference's
    arithmetic), else "none"."""
    if str(device) != "cpu":
        return "none", f"device {device}"
    if dtype != torch.float32:
        return "none", f"{str(dtype).removeprefix('torch.')} activations: weights in that dtype"
    reason = _kernels_off(cpu_kernels)
    if reason is not None:
        return "none", f"firsttoken's kernels not used: {reason}"
    stored = stored_linear_dtypes(model_dir)
    if stored != {"BF16"}:
        return "none", f"the checkpoint's language-model linear weights are {'/'.join(sorted(stored)) or 'absent'}"
    return "bf16", "the checkpoint stores its language model's linear weights in bf16; float32 activations"


def _kernels_off(cpu_kernels: str) -> str | None:
    """Why quantized weights (int8, bf16) go without firsttoken's kernels, or None: they take them on any CPU the
    kernels build for, whatever ``kernels_skipped`` says of float32 (their alternative is no MKL product)."""
    return "--cpu-kernels off" if cpu_kernels == "off" else kernel_unavailable()


def stored_linear_dtypes(model_dir: Path) -> set[str]:
    """The safetensors dtypes ("BF16", "F32", ...) of the checkpoint's language-model projection weights (every
    ``*_proj.weight`` outside the vision tower, and the lm_head), read from the files' headers."""
    dtypes: set[str] = set()
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if "visual" not in key and (key.endswith("_proj.weight") or key.endswith("lm_head.weight")):
                    dtypes.add(f.get_slice(key).get_dtype())
    return dtypes


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return [model_dir / name for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return files
