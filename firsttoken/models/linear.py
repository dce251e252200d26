"""A linear layer whose product is its method's, chosen once when the model is built (vLLM's
``quant_method``).

Model code builds ``Linear(in_features, out_features, bias)`` and calls it; it never asks which
kernel, weight dtype, layout or device computes the product. The contract of a ``LinearMethod``:

    process_weights(layer)   once, after the checkpoint's weights are in ``layer.weight`` / ``layer.bias`` (and a
                             tied layer's weight is its embedding's): keep them as the method computes with them
                             (another layout, a quantized or packed copy; the checkpoint's tensor is dropped where
                             it is replaced, so its memory is freed before the next layer's copy is made)
    apply(layer, x)          x [..., in_features] -> [..., out_features]: what ``nn.Linear`` computes, in the
                             method's arithmetic

A layer's method is set by the loader before any weight is read (loading/methods.py: from the
resolved plan, the layer's name and shape, and the machine's features), so the same model code runs
float32 via torch, the few-rows CPU kernels, bf16 / fp16 / int8 weights, or a CUDA method. Until one
is set a layer is ``nn.Linear`` (``TORCH``), so a module built in a test without the loader computes
as before.

This module imports no kernels: the methods that call them live in loading/kernel_linear.py and
loading/quant.py.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    name: str  # what the start-up log and GET /v1/engine/config call it

    def process_weights(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class TorchLinear:
    """``F.linear`` on the layer's own weight: the reference arithmetic, on any device torch runs
    on.

    ``input_major``: a float32 weight that widens (out_features >= in_features) is stored
    input-major: the same [out, in] parameter (same values, names, shapes), laid out so that
    ``weight.t()`` is contiguous. ``F.linear`` then hands the BLAS a plain, untransposed [in, out]
    matrix, and the one-row products of decoding stream it at memory speed, faster than the
    row-major layout for a few rows and equal from 16 rows up. A narrowing weight (the MLP's
    down_proj, 1408 -> 512) is the other way round: there MKL's row-major dot products are faster,
    so it keeps the checkpoint's layout. Only float32: bf16 (emulated on AVX2) is much slower in
    that layout (why, all three: docs/runs/notes/decode-kernels.md#decode-per-step-issue-17 and its
    second pass). The BLAS then sums in another order: one-row outputs change at rounding level
    (small checkpoint: max |dlogit| 7e-5, same argmax)."""

    def __init__(self, input_major: bool = False) -> None:
        self.input_major = input_major
        self.name = "torch, input-major" if input_major else "torch"

    def process_weights(self, layer: Linear) -> None:
        if self.input_major:
            store_input_major(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


TORCH = TorchLinear()


def store_input_major(layer: nn.Linear) -> bool:
    """``layer``'s weight input-major (``TorchLinear``'s ``input_major``) where it is a float32
    [out, in] matrix that widens and is not so already; returns whether it changed."""
    weight = layer.weight
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.t().is_contiguous():
        return False
    if layer.in_features > layer.out_features:
        return False
    layer.weight = nn.Parameter(
        weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad
    )
    return True


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, names and initialization) whose forward is its
    ``method``'s.

    ``tied_to``: an lm_head that reads its embedding's weight. It registers no weight of its own
    (the checkpoint has none, and parameter counts stay the model's); ``tie()`` gives it that weight
    once it is loaded, and its method keeps it as any other (a quantized method makes its own copy;
    the embedding stays as it is for lookups).
    """

    method: LinearMethod = TORCH

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 tied_to: nn.Embedding | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # a tuple: not registered as a submodule
        self._tied_to = () if tied_to is None else (tied_to,)
        if tied_to is not None:
            self.register_parameter("weight", None)

    @property
    def is_tied(self) -> bool:
        return bool(self._tied_to)

    def tie(self) -> None:
        """A tied layer takes its embedding's (loaded) weight: the same parameter, no copy."""
        if self._tied_to:
            self.weight = self._tied_to[0].weight

    @classmethod
    def of(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, method: LinearMethod = TORCH
    ) -> Linear:
        """A layer holding these very tensors (no copy; a plain tensor becomes a parameter without
        gradients) as its weight and bias, processed by ``method``: what a model's layer is once
        loaded."""
        out_features, in_features = weight.shape
        with torch.device("meta"):
            layer = cls(in_features, out_features, bias=bias is not None)
        layer.weight = _parameter(weight)
        layer.bias = None if bias is None else _parameter(bias)
        layer.method = method
        method.process_weights(layer)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        tied = ", tied to the embeddings" if self.is_tied else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, method={self.method.name}{tied}"


def _parameter(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
