"""Load a checkpoint (safetensors, single file or sharded) into its family's model, as its plan
says.

The family says how checkpoint names map onto our parameters (models/weights.py: prefixes, stacked
projections, reshapes); the plan (loading/load_plan.py) says how the model runs here, and
loading/methods.py turns it into each layer's method before any weight is read. This module builds
the model on the meta device, binds the methods, reads the files and hands the weights to the
methods. Tensors are read one at a time and cast straight to the target dtype, so a bf16 load never
holds an fp32 copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import math
import zlib

import torch
from safetensors import safe_open
from torch import nn

from firsttoken.attention.base import AttentionBackend
from firsttoken.attention.registry import get_backend
from firsttoken.attention.sdpa import SdpaBackend
from firsttoken.config import CpuKernels, Quantization
from firsttoken.loading.methods import LayerMethods
from firsttoken.loading.load_plan import plan_model
from firsttoken.loading.plan_values import Machine, ModelPlan
from firsttoken.models.registry import family_of, load_model_config
from firsttoken.models.weight_files import safetensors_files, stored_linear_dtypes

__all__ = ["build_model", "dummy_tensor", "load_model", "stored_linear_dtypes"]

DUMMY_SEED = 0  # --load-format dummy: the same config gives the same weights, run after run


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend | None = None,
    quantization: Quantization = "none",
    num_threads: int | None = None,
    cpu_kernels: CpuKernels = "auto",
    machine: Machine | None = None,
) -> nn.Module:
    """The family's model in eval mode with weights from model_dir, planned from these choices on
    ``machine`` (default: this one): ``plan_model`` then ``build_model``. attn_backend defaults to
    "sdpa"; ``quantization`` and ``cpu_kernels`` as the flags (loading/load_plan.py); ``num_threads`` 1:
    the engine runs on one torch thread."""
    machine = machine or Machine.for_flags(cpu_kernels, torch.device(device).type)
    backend = (
        "sdpa"
        if attn_backend is None or isinstance(attn_backend, SdpaBackend)
        else type(attn_backend).__name__
    )
    plan = plan_model(
        model_dir,
        str(dtype).removeprefix("torch."),
        quantization,
        cpu_kernels,
        machine,
        torch.device(device).type,
        backend,
        num_threads,
    )
    return build_model(model_dir, plan, machine, attn_backend)


def build_model(model_dir: str | Path, plan: ModelPlan, machine: Machine,
                attn_backend: AttentionBackend | None = None) -> nn.Module:
    """The family's model in eval mode, every layer's method bound from ``plan``
    (loading/methods.py), weights from model_dir."""
    model_dir = Path(model_dir)
    family = family_of(model_dir)
    config = load_model_config(model_dir)
    methods = LayerMethods(plan, machine)
    with torch.device("meta"):
        model = family.build(config, attn_backend or get_backend(plan.attention_backend))
    methods.bind(
        model, family.decoder_layout(config) if family.decoder_layout is not None else None
    )
    expected = {name: p.shape for name, p in model.named_parameters()}
    device, dtype = plan.device, plan.torch_dtype

    def tensors() -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        for file in safetensors_files(model_dir):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, lambda key=key, f=f: f.get_tensor(key).to(device=device, dtype=dtype)

    # tied: the reference uses embed_tokens, any lm_head tensor is ignored
    tied = config.tie_word_embeddings
    if plan.load_format == "dummy":  # our own names and shapes: nothing to map, nothing missing
        state = {name: dummy_tensor(name, shape, dtype, device) for name, shape in expected.items()}
        unexpected: list[str] = []
    else:
        state, unexpected = family.weights.load_state(
            tensors(), expected, drop=lambda n: tied and n.startswith("lm_head.")
        )
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
    # the model holds the only reference now: a replaced weight frees its original at once
    del state
    model.requires_grad_(False)
    methods.process_weights(model)
    return model.eval()


def dummy_tensor(name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str, seed: int = DUMMY_SEED) -> torch.Tensor:
    """--load-format dummy's weight ``name``: made where it will live (a CUDA device draws its own
    numbers, so a 7B model takes seconds, not a CPU's minutes), from a generator seeded by (seed,
    name) on that device. Scaled as the demo checkpoint's (models/checkpoint.py) so activations stay
    O(1): matrices and convolutions N(0, 1/fan_in), embeddings N(0, 1), 1-D weights (norms) 1 + N(0,
    0.1^2), biases N(0, 0.1^2). The numbers differ between devices (each draws its own); only the
    shapes and the scale are the contract. ``device`` "meta": shapes only, nothing allocated."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if out.is_meta:
        return out
    gen = torch.Generator(device=out.device).manual_seed(
        seed * 1_000_003 + zlib.crc32(name.encode())
    )
    if name.endswith(".bias"):
        return out.normal_(0.0, 0.1, generator=gen)
    if out.dim() == 1:
        return out.normal_(1.0, 0.1, generator=gen)
    if "embed_tokens" in name:
        return out.normal_(0.0, 1.0, generator=gen)
    return out.normal_(0.0, 1.0 / math.sqrt(math.prod(out.shape[1:])), generator=gen)
