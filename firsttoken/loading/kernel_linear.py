"""The few-rows kernels as a linear layer's method (models/linear.py): decode steps' products on the
CPU.

``FewRowsKernel`` computes products of at most ``MAX_ROWS`` rows (the library's ``max_rows_bf16``
for bfloat16) with firsttoken's kernels (kernels/cpu_linear.py: each weight read once in one sweep,
every row using it while it is in cache); larger inputs (a prefill's), and anything autograd must
see, take ``F.linear`` on the same weight. The weight keeps the model's dtype (float32 or bfloat16)
in the layout the plan gave it: row-major, or, where ``input_major`` (widening float32 weights on
AVX-512 CPUs: loading/load_plan.py ``keeps_row_major``), as ``TorchLinear`` stores it. A bfloat16
weight's bias is widened once (``layer.bias32``): the kernel sums in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from firsttoken.kernels.cpu_linear import MAX_ROWS, kernel_takes
from firsttoken.models.linear import Linear, store_input_major


class FewRowsKernel:
    def __init__(self, kernels, input_major: bool = False) -> None:
        """``kernels``: the built library (kernels/cpu_linear.py's, checked at start-up)."""
        self.kernels = kernels
        self.input_major = input_major
        self.name = "few-rows kernels, input-major" if input_major else "few-rows kernels"

    def process_weights(self, layer: Linear) -> None:
        if self.input_major:
            store_input_major(layer)
        if layer.weight.dtype == torch.bfloat16 and layer.bias is not None:
            layer.bias32 = layer.bias.detach().float().contiguous()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        rows = x.reshape(-1, layer.in_features)
        limit = self.kernels.max_rows_bf16 if x.dtype == torch.bfloat16 else MAX_ROWS
        if rows.shape[0] > limit or rows.shape[0] == 0 or x.dtype != weight.dtype or (
                torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, layer.bias)
        # float32 sums rounded to bf16 at the end, as torch's bf16 product
        if x.dtype == torch.bfloat16:
            out = self.kernels.linear(
                rows.float(), weight, getattr(layer, "bias32", None), bf16_rows=True
            )
            return out.to(torch.bfloat16).view(*x.shape[:-1], layer.out_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self.kernels.linear(rows, weight, layer.bias)
        return out.view(*x.shape[:-1], layer.out_features)

    # ---- what the fused decode layers read (loading/fused_decode.py)
    def fuses(self, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
        """Whether the fused decode layers run this product for ``dtype`` activations: the kernels
        take its shape and layout (the weight is in the model's dtype)."""
        return kernel_takes(
            out_features, in_features, dtype, self.input_major and in_features <= out_features
        )

    def fused_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.weight, None

    def fused_bias(self, layer: Linear) -> torch.Tensor | None:
        """The bias in float32 (the kernels sum in float32)."""
        bias = layer.bias
        return bias if bias is None or bias.dtype == torch.float32 else layer.bias32
