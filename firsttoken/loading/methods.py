"""Which method each layer of a model takes: chosen once, from the model's plan and the machine,
before any weight is read (vLLM's ``quant_method``, picked per layer from the quantization config).

``LayerMethods(plan, machine).bind(model, layout)`` sets every ``Linear``'s method
(models/linear.py) and the model's decode method (models/decode.py); after the checkpoint is loaded,
``process_weights(model)`` lets each method keep its layer's weights as it computes with them. The
rules, per linear layer (its name in the model, its shape):

    --quantization int8    every layer but the vision tower's patch embedding: int8 weights (loading/quant.py)
    --quantization fp16    the language model's (names outside ``visual.``): packed float16 weights
    --quantization bf16    the language model's: bf16 weights beside float32 activations
    none                   the language model's: the few-rows kernels where the plan takes them and the kernels
                           take the layer's shape and layout, else torch's product; widening float32 weights
                           input-major where the plan says so (``ModelPlan.weights_input_major``)
    the vision tower       torch's product on the checkpoint's layout (int8 aside)

A tied lm_head is one more layer: it reads the embeddings (a quantized method makes its own copy;
the embeddings stay as they are for lookups), never input-major. Where the plan takes the fused
decode layers (``plan.fused_decode`` is None), the model's decode method is ``FusedDecode`` over its
family's ``DecoderLayout``.
"""

from __future__ import annotations

import torch
from torch import nn

from firsttoken.kernels.cpu_linear import kernel_takes
from firsttoken.loading.fused_decode import FusedDecode, fused_decode_unsupported, method_fuses
from firsttoken.loading.kernel_linear import FewRowsKernel
from firsttoken.loading.plan_values import Machine, ModelPlan
from firsttoken.loading.quant import INT8_KEEPS_FLOAT, Bf16Weights, Fp16Weights, Int8Weights
from firsttoken.models.decode import EAGER, DecoderLayout
from firsttoken.models.interfaces import DecodeMethod
from firsttoken.models.linear import TORCH, Linear, LinearMethod, TorchLinear

VISION_PREFIX = "visual."  # the vision tower's layers: outside the language model's methods


class LayerMethods:
    def __init__(self, plan: ModelPlan, machine: Machine) -> None:
        self.plan = plan
        kernels = machine.kernels if plan.kernels_unused is None else None
        self._kernels = kernels
        self._int8 = Int8Weights(kernels, machine.int_mm_exact)
        self._fp16 = Fp16Weights(plan.fp16_multithreaded) if plan.quantization == "fp16" else None
        self._bf16 = Bf16Weights(kernels)
        self._few_rows = (
            {im: FewRowsKernel(kernels, im) for im in (False, True)} if kernels is not None else {}
        )
        self._input_major = TorchLinear(input_major=True)

    def linear(
        self, name: str, in_features: int, out_features: int, bias: bool, tied: bool
    ) -> LinearMethod:
        """The method of the linear layer named ``name`` (in the model) with this shape."""
        quantization = self.plan.quantization
        if quantization == "int8" and not name.startswith(INT8_KEEPS_FLOAT):
            return self._int8
        if name.startswith(VISION_PREFIX):
            return TORCH
        if quantization == "fp16":
            return self._fp16
        if quantization == "bf16":
            return self._bf16
        dtype = self.plan.torch_dtype
        input_major = self.plan.weights_input_major and not tied and in_features <= out_features
        if self._kernels is not None and kernel_takes(
            out_features, in_features, dtype, input_major
        ):
            return self._few_rows[input_major]
        return self._input_major if input_major else TORCH

    def fused_decode_unsupported(self, layout: DecoderLayout | None) -> str | None:
        """Why the fused decode layers do not take this decoder's decode steps, or None (the plan
        asks this)."""
        if self._kernels is None:
            return self.plan.kernels_unused or "the few-rows kernels are not built"
        return fused_decode_unsupported(
            layout, self.linear, self.plan.torch_dtype, self.plan.attention_backend
        )

    def decode(self, layout: DecoderLayout | None) -> DecodeMethod:
        if self.plan.fused_decode is not None or layout is None:
            return EAGER
        dtype = self.plan.torch_dtype
        head = method_fuses(
            self.linear(
                layout.lm_head, layout.hidden_size, layout.vocab_size, False, layout.tied_lm_head
            ),
            layout.hidden_size,
            layout.vocab_size,
            dtype,
        )
        return FusedDecode(layout, self._kernels, dtype, head=head)

    def bind(self, model: nn.Module, layout: DecoderLayout | None) -> None:
        """Every linear layer's method and the decode method, on the model as built (before its
        weights). A plain ``nn.Linear`` cannot take a method: one that this plan would give anything
        but torch's product is refused (a family builds its layers as models/linear.py's
        ``Linear``)."""
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                module.method = self.linear(
                    name,
                    module.in_features,
                    module.out_features,
                    module.bias is not None,
                    module.is_tied,
                )
            elif isinstance(module, nn.Linear):
                wants = self.linear(
                    name, module.in_features, module.out_features, module.bias is not None, False
                )
                if wants is not TORCH:
                    raise TypeError(
                        f"{name} is a torch nn.Linear, which cannot take {wants.name}: build it as "
                        "firsttoken.models.linear.Linear"
                    )
        if hasattr(model, "decode"):
            model.decode = self.decode(layout)

    @staticmethod
    def process_weights(model: nn.Module) -> None:
        """After the checkpoint's weights are in: each linear layer's method, then the decode
        method, keeps them as it computes with them. One layer at a time, so a replaced weight is
        freed before the next copy is made."""
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Linear):
                    module.tie()
                    module.method.process_weights(module)
            decode = getattr(model, "decode", None)
            if decode is not None:
                decode.process_weights(model)
