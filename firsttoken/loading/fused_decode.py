"""A decode step's decoder layers in one C call (``ft_decode_layers`` in cpu_linear.c), bf16 or
float32.

Op by op, a decode step issues over a thousand small tensor ops (per layer two norms, the rotary,
the cache write, SDPA, residuals and the MLP's activation around the four products), each paying a
fixed dispatch cost whatever its size: at batch 1 a large share of the step's forward (why:
docs/runs/notes/decode-kernels.md#a-decode-steps-layers-in-one-call). ``FusedDecode`` hands the
whole stack of layers to one C function for pure-decode steps of at most ``MAX_ROWS_FUSED_BF16``
rows (16 where the bf16 products take AVX512-BF16 dot products; float32: ``MAX_ROWS``): the same
products (the few-rows kernels the eager step calls, each weight in its stored layout), the eager
path's rounding points everywhere else (bf16: every bf16 tensor rounded; float32: none), and
attention straight from the paged cache (no gather, no mask). The attention's and the norm's float32
sums go in another order than torch's, so a hidden state may differ from the eager path's by a
rounding step (tests/oracle/test_fused_decode.py bounds it against float64 arithmetic on the same
weights). A row's results do not depend on the other rows of its step. Where the lm_head's method is
one these kernels run too, the model's final norm and its lm_head run in the same call when the
runner asks for every row's logits (``ForwardOutput.logits``): Python is entered once per step,
after the logits, instead of once more between two calls that stream weights (the first op after one
runs from cold caches).

``FusedDecode`` is a decode method (models/decode.py): the plan takes it (loading/load_plan.py) where the
few-rows kernels are taken (``--cpu-kernels``) for a bfloat16 or float32 language model on the CPU
with the SDPA backend, and for float32 activations with bf16 weights (``--quantization bf16``: each
product reads its bf16 weight as the eager ``Bf16Weights`` method does) or int8 weights
(``--quantization int8``: each product quantizes its rows and multiplies as the eager
``Int8Weights`` kernel does: the same numbers), and where ``fused_decode_unsupported`` finds every
projection of the family's ``DecoderLayout`` one it runs; prefill, mixed steps, steps of more rows,
steps with images and fp16 weights keep the eager layers (the model's ``decoder_layers``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from firsttoken.attention.base import AttentionMetadata
from firsttoken.kernels.cpu_linear import MAX_ROWS, MAX_ROWS_BF16_DP, kernel_threads
from firsttoken.models.decode import DecoderLayout
from firsttoken.models.interfaces import DecoderModel, ForwardOutput, ImageRows
from firsttoken.models.layers import rolled_sin
from firsttoken.models.linear import Linear, LinearMethod

# bf16 steps of up to 8 rows where the bf16 products take the AVX2 loop, up to MAX_ROWS_BF16_DP = 16
# with the dot-product loop (CPUs with AVX512-BF16): the most rows at which the fused step beats the
# eager one (why: docs/runs/notes/decode-kernels.md#a-decode-steps-layers-in-one-call,
# #bf16-products-as-avx512-bf16-dot-products)
MAX_ROWS_FUSED_BF16 = 8

_P = ctypes.c_void_p


# cpu_linear.c's KIND_*: a weight's dtype and layout
KIND_BF16_RM, KIND_F32_RM, KIND_F32_IM, KIND_I8_IM, KIND_I8_BLK = 0, 1, 2, 3, 4


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _P),
        ("post_norm", _P),
        ("qkv_w", _P),
        ("qkv_b", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("o_w", _P),
        ("gate_up_w", _P),
        ("down_w", _P),
        ("qkv_kind", ctypes.c_int32),
        ("o_kind", ctypes.c_int32),
        ("gate_up_kind", ctypes.c_int32),
        ("down_kind", ctypes.c_int32),
        ("qkv_s", _P),
        ("o_s", _P),
        ("gate_up_s", _P),
        ("down_s", _P),
    ]


class FusedMethod(Protocol):
    """A linear method whose products the fused layers run themselves (loading/kernel_linear.py's,
    loading/quant.py's bf16 and int8 weights)."""

    def fuses(self, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
        """For ``dtype`` activations, from the layer's shape alone (the plan asks before any weight
        is loaded)."""
        ...

    def fused_weight(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight the fused product reads, and its per-output scales (int8) or None."""
        ...

    def fused_bias(self, layer: Linear) -> torch.Tensor | None:
        """The bias in float32, or None."""
        ...


def method_fuses(
    method: LinearMethod, in_features: int, out_features: int, dtype: torch.dtype
) -> bool:
    fuses = getattr(method, "fuses", None)
    return fuses is not None and fuses(in_features, out_features, dtype)


def _kind(weight: torch.Tensor) -> int:
    if weight.dtype == torch.int8:
        return KIND_I8_BLK if weight.dim() == 3 else KIND_I8_IM
    if weight.dtype == torch.bfloat16:
        return KIND_BF16_RM
    return KIND_F32_RM if weight.is_contiguous() else KIND_F32_IM


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# (name, in, out, bias, tied) -> the layer's method
MethodFor = Callable[[str, int, int, bool, bool], LinearMethod]


def fused_decode_unsupported(
    layout: DecoderLayout | None, method_for: MethodFor, dtype: torch.dtype, attention_backend: str
) -> str | None:
    """None when ``FusedDecode`` takes this decoder's decode steps, else why not: from the family's
    layout and the methods its projections get (``method_for``), before any weight is loaded. The
    caller checked that the kernels are in use."""
    if layout is None:
        return "the model family declares no decoder layout"
    if attention_backend != "sdpa":
        return f"attention backend {attention_backend} (the fused layers read the SDPA backend's paged cache)"
    if layout.rotary != "half-split":
        return f"{layout.rotary} rotary unsupported"
    if layout.head_dim % 8 or layout.head_dim > 512 or layout.num_heads % layout.num_kv_heads:
        return f"head_dim {layout.head_dim} / heads {layout.num_heads}:{layout.num_kv_heads} unsupported"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} activations (bfloat16 and float32 only)"
    for name, in_features, out_features, bias in layout.projections():
        if not method_fuses(
            method_for(name, in_features, out_features, bias, False),
            in_features,
            out_features,
            dtype,
        ):
            return "decoder weights the few-rows kernels do not take"
    return None


class FusedDecode:
    """The decoder layers of a family's ``DecoderLayout`` as one C call per pure-decode step, in the
    model's dtype (bfloat16 or float32). ``process_weights`` points it at the model's loaded
    parameters (and a bf16 qkv bias's float32 copy); whatever replaces one after that must process
    them again. ``head``: the final norm and the lm_head run in the same call where the runner asks
    for every row's logits."""

    def __init__(self, layout: DecoderLayout, kernels, dtype: torch.dtype, head: bool) -> None:
        """``kernels``: the built library (kernels/cpu_linear.py's)."""
        self.layout = layout
        self.dtype = dtype
        self.with_head = head
        self.name = "fused decode layers" + (" + final norm and lm_head" if head else "")
        self._fn = kernels.lib.ft_decode_layers
        i64, p = ctypes.c_int64, ctypes.c_void_p
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            p,
            i64,
            p,
            i64,
            p,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            p,
            p,
            p,
            i64,
            p,
            p,
            i64,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
            p,
            p,
            ctypes.c_int32,
            p,
            i64,
            p,
        ]
        if dtype != torch.bfloat16:
            self.max_rows = MAX_ROWS
        # the dot-product loop's products beat torch's up to its own limit; the AVX2 loop's up to 8
        # rows
        else:
            self.max_rows = MAX_ROWS_BF16_DP if kernels.bf16_dp else MAX_ROWS_FUSED_BF16
        self.scale = layout.head_dim**-0.5
        self.num_layers = len(layout.layers)
        self._layers = None
        self._final_norm: nn.Module | None = None
        # the lm_head whose product rides in the call, once processed
        self.head: Linear | None = None
        self._head_args: tuple = (None, None, 0, None, 0)
        self.steps = 0  # pure-decode steps taken here (tests read it)

    def process_weights(self, model: nn.Module) -> None:
        part = model.get_submodule
        layers = (_Layer * self.num_layers)()
        for i, p in enumerate(self.layout.layers):
            qkv, o, gu, down = (
                part(name) for name in (p.qkv_proj, p.o_proj, p.gate_up_proj, p.down_proj)
            )
            (qkv_w, qkv_s), (o_w, o_s), (gu_w, gu_s), (down_w, down_s) = (
                lin.method.fused_weight(lin) for lin in (qkv, o, gu, down))
            norms = [part(p.input_norm).weight, part(p.post_norm).weight]
            norms += [part(n).weight for n in (p.q_norm, p.k_norm) if n is not None]
            if any(t.dtype != self.dtype or not t.is_contiguous() for t in norms):
                raise ValueError(f"layer {i}: norm weights are not {self.dtype}")
            layers[i] = _Layer(
                _ptr(norms[0]),
                _ptr(norms[1]),
                _ptr(qkv_w),
                _ptr(qkv.method.fused_bias(qkv)),
                _ptr(part(p.q_norm).weight if p.q_norm else None),
                _ptr(part(p.k_norm).weight if p.k_norm else None),
                _ptr(o_w),
                _ptr(gu_w),
                _ptr(down_w),
                _kind(qkv_w),
                _kind(o_w),
                _kind(gu_w),
                _kind(down_w),
                _ptr(qkv_s),
                _ptr(o_s),
                _ptr(gu_s),
                _ptr(down_s),
            )
        self._layers = layers
        self._final_norm = part(self.layout.final_norm)
        # the final norm and the lm_head in the same call, where the lm_head's method is one these
        # kernels run: the first Python after a call that streamed every weight runs from cold
        # caches, several times slower than warm (why:
        # docs/runs/notes/decode-kernels.md#the-kernels-own-threads), so one re-entry per step
        # instead of two
        if self.with_head:
            head, norm = part(self.layout.lm_head), self._final_norm.weight
            if head.bias is not None or norm.dtype != self.dtype or not norm.is_contiguous():
                raise ValueError(
                    "the lm_head the fused call runs has a bias or its final norm another dtype"
                )
            w, scales = head.method.fused_weight(head)
            self.head = head
            # ft_decode_layers' last arguments but the logits: (final norm, lm_head weight, its
            # kind, its scales, vocabulary)
            self._head_args = (
                norm.data_ptr(),
                w.data_ptr(),
                _kind(w),
                _ptr(scales),
                head.out_features,
            )

    def takes(self, num_rows: int) -> bool:
        """Would a pure-decode step of this many rows come here (the runner sets its threads by
        it)?"""
        return 0 < num_rows <= self.max_rows

    def applies(
        self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]
    ) -> bool:
        return (self.takes(x.shape[0]) and meta.is_pure_decode and kv_caches[0].dtype == self.dtype
                and kv_caches[0].is_contiguous())

    def run(self, model: DecoderModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: AttentionMetadata, images: Sequence[ImageRows],
            all_logits: bool) -> ForwardOutput:
        if images or not self.applies(x, meta, kv_caches):
            return ForwardOutput(model.decoder_layers(x, cos, sin, kv_caches, meta, images))
        if self.head is None or not all_logits:
            return ForwardOutput(self._final_norm(self(x, cos, rolled_sin(sin), kv_caches, meta)))
        hidden, logits = self(x, cos, rolled_sin(sin), kv_caches, meta, with_head=True)
        return ForwardOutput(hidden, logits)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_rolled: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        with_head: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [M, hidden] contiguous in the model's dtype, the step's embeddings: overwritten with
        the last layer's output (the final norm is the caller's). cos, sin_rolled [M, head_dim]
        contiguous, the same dtype. Writes the rows' keys and values into ``kv_caches``.
        ``with_head`` (only where ``self.head`` is set): x is overwritten with the final norm's
        output instead, and the lm_head's logits [M, vocab] float32 come back beside it."""
        m = x.shape[0]
        kv = (ctypes.c_void_p * self.num_layers)(*(t.data_ptr() for t in kv_caches))
        seq_lens = (ctypes.c_int64 * m)(*meta.seq_lens)
        # int32 [M, blocks], int64 [M]: AttentionMetadata.build
        table, slots = meta.block_tables, meta.slot_mapping
        logits = torch.empty(m, self.head.out_features, dtype=torch.float32) if with_head else None
        lay = self.layout
        rc = self._fn(
            self._layers,
            self.num_layers,
            kv,
            kv_caches[0].stride(0),
            x.data_ptr(),
            m,
            lay.hidden_size,
            lay.num_heads,
            lay.num_kv_heads,
            lay.head_dim,
            lay.intermediate_size,
            lay.rms_norm_eps,
            cos.data_ptr(),
            sin_rolled.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            seq_lens,
            slots.data_ptr(),
            meta.block_size,
            self.scale,
            self.dtype == torch.bfloat16,
            kernel_threads(),
            *(self._head_args if with_head else (None, None, 0, None, 0)),
            _ptr(logits),
        )
        if rc != 0:
            raise MemoryError("fused decode layers: no scratch memory")
        self.steps += 1
        return x if logits is None else (x, logits)
