"""A decode step's decoder layers in one C call (``ft_decode_layers`` in cpu_linear.c), bf16 or float32.

At batch 1 a decode step of the `small` checkpoint in bf16 issued ~1,440 tensor ops (float32 ~1,030): per layer two
norms, the rotary, the cache write, SDPA, residuals and the MLP's activation around the four products. Each costs
~1-3 us of dispatch whatever its size, so outside the products the step's forward spent ~2 ms (one thread,
AVX512-BF16 EPYC: forward 4.4 ms, of which the products' weights at memory speed ~2.6). ``FusedDecoder`` hands the
whole stack of layers to one C function for pure-decode steps of at most ``MAX_ROWS_FUSED_BF16`` rows (16 where the
bf16 products take AVX512-BF16 dot products; float32: ``MAX_ROWS``): the same products (the few-rows kernels the
eager step calls, each weight in its stored layout), the eager path's rounding points everywhere else (bf16: every
bf16 tensor rounded; float32: none), and attention straight from the paged cache (no gather, no mask). The
attention's and the norm's float32 sums go in another order than torch's, so a hidden state may differ from the
eager path's by a rounding step (tests/oracle/test_fused_decode.py bounds it against float64 arithmetic on the same
weights). A row's results do not depend on the other rows of its step. Where the lm_head is the kernels'
(``FewRowsLinear``), the model's final norm and its lm_head run in the same call, and ``compute_logits`` returns
those logits for the step's rows: Python is entered once per step, after the logits, instead of once more between
two calls that stream weights (the first op after one runs from cold caches).

Taken where the few-rows kernels are (``--cpu-kernels``: see ``kernels_skipped``) for a bfloat16 or float32
language model on the CPU with the SDPA backend, and for float32 activations with bf16 weights (``--quantization
bf16``: each product reads its bf16 weight as the eager ``Bf16WeightLinear`` does) or int8 weights (``--quantization
int8``: each product quantizes its rows and multiplies as the eager ``Int8Linear``'s kernel does: the same numbers);
prefill, mixed steps, steps of more rows, fp16 weights keep the eager layers.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from firsttoken.attention.base import AttentionMetadata
from firsttoken.kernels.cpu_linear import (
    MAX_ROWS,
    MAX_ROWS_BF16_DP,
    FewRowsLinear,
    _kernel,
    kernel_applies,
    kernel_threads,
)
from firsttoken.models.quant import Bf16WeightLinear, Int8Linear

# bf16 steps of up to 8 rows where the bf16 products take the AVX2 loop: the fused layers against the eager layers
# (torch's AVX512-BF16 products above MAX_ROWS_BF16 = 4 rows), whole in-process decode steps, one thread, `small`
# checkpoint, AVX512-BF16 EPYC: 6 rows 0.61x, 8 rows 0.82x, 12 rows 0.97x, 16 rows 1.28x the eager step's time.
# With the dot-product loop (CPUs with AVX512-BF16): up to MAX_ROWS_BF16_DP = 16 rows (8 / 12 / 16 rows 0.61x /
# 0.59x / 0.66x the eager step of the commit before, whose 12 and 16 rows were torch's products; docs/performance.md)
MAX_ROWS_FUSED_BF16 = 8

_P = ctypes.c_void_p


# cpu_linear.c's KIND_*: a weight's dtype and layout
KIND_BF16_RM, KIND_F32_RM, KIND_F32_IM, KIND_I8_IM, KIND_I8_BLK = 0, 1, 2, 3, 4


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _P), ("post_norm", _P), ("qkv_w", _P), ("qkv_b", _P), ("q_norm", _P), ("k_norm", _P),
                ("o_w", _P), ("gate_up_w", _P), ("down_w", _P), ("qkv_kind", ctypes.c_int32),
                ("o_kind", ctypes.c_int32), ("gate_up_kind", ctypes.c_int32), ("down_kind", ctypes.c_int32),
                ("qkv_s", _P), ("o_s", _P), ("gate_up_s", _P), ("down_s", _P)]


def _kind(weight: torch.Tensor) -> int:
    if weight.dtype == torch.int8:
        return KIND_I8_BLK if weight.dim() == 3 else KIND_I8_IM
    if weight.dtype == torch.bfloat16:
        return KIND_BF16_RM
    return KIND_F32_RM if weight.is_contiguous() else KIND_F32_IM


def _weight(lin: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the weight a fused product reads, its per-output scales or None): an Int8Linear's int8 weight ([K, N], or
    in the kernels' blocks)."""
    if isinstance(lin, Int8Linear):
        return lin.qweight, lin.scale
    return lin.weight, None


def _takes(lin: nn.Module, dtype: torch.dtype) -> bool:
    """A linear layer whose product the fused layers run for ``dtype`` activations: the kernels' layouts of that
    dtype; beside float32 activations also a row-major bf16 weight (--quantization bf16: widened exactly, float32
    sums) and an Int8Linear the kernels take (--quantization int8: each row quantized with its own scale, exact
    int32 sums, as its eager product)."""
    if isinstance(lin, Int8Linear):
        return dtype == torch.float32 and lin.use_kernels and lin.kernel_shape
    weight = getattr(lin, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return False
    same = weight.dtype == dtype or (dtype == torch.float32 and weight.dtype == torch.bfloat16)
    return same and kernel_applies(weight)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """The decoder layers of a ``Qwen2VLModel`` (any family built on it) as one C call per decode step, in the
    model's dtype (bfloat16 or float32). Points at the model's parameters (and a bf16 qkv bias's float32 copy, which
    its FewRowsLinear holds); whatever replaces one after load must build a new FusedDecoder."""

    def __init__(self, model: nn.Module) -> None:
        lib = _kernel()[0]
        assert lib is not None
        self._fn = lib.lib.ft_decode_layers
        i64, p = ctypes.c_int64, ctypes.c_void_p
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [p, i64, p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p, i64, p, p,
                             i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, p, p, ctypes.c_int32, p, i64, p]
        self.dtype = model.embed_tokens.weight.dtype
        if self.dtype != torch.bfloat16:
            self.max_rows = MAX_ROWS
        else:  # the dot-product loop's products beat torch's up to its own limit; the AVX2 loop's up to 8 rows
            self.max_rows = MAX_ROWS_BF16_DP if lib.bf16_dp else MAX_ROWS_FUSED_BF16
        c = model.config
        self.hidden, self.heads, self.kv_heads, self.head_dim = c.hidden_size, c.num_attention_heads, \
            c.num_key_value_heads, c.head_dim
        self.intermediate, self.eps = c.intermediate_size, float(c.rms_norm_eps)
        self.num_layers = len(model.layers)
        layers = (_Layer * self.num_layers)()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            bias32 = attn.qkv_proj.bias  # the kernels sum in float32: a bf16 bias's float32 copy, made at load
            if bias32 is not None and bias32.dtype != torch.float32:
                bias32 = attn.qkv_proj.bias32
            (qkv, qkv_s), (o, o_s), (gu, gu_s), (down, down_s) = (
                _weight(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            layers[i] = _Layer(
                _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight), _ptr(qkv),
                _ptr(bias32), _ptr(attn.q_norm.weight if attn.q_norm else None),
                _ptr(attn.k_norm.weight if attn.k_norm else None), _ptr(o), _ptr(gu), _ptr(down), _kind(qkv),
                _kind(o), _kind(gu), _kind(down), _ptr(qkv_s), _ptr(o_s), _ptr(gu_s), _ptr(down_s))
        self._layers = layers
        self.scale = model.layers[0].self_attn.scale
        # the final norm and the lm_head in the same call, where the eager lm_head is these kernels' (FewRowsLinear):
        # the first Python after a call that streamed every weight runs from cold caches (the eager final norm of
        # one row took ~0.1-0.2 ms there, ~27 us warm), so one re-entry per step instead of two
        head = model.lm_head
        self.head = head if isinstance(head, (FewRowsLinear, Bf16WeightLinear, Int8Linear)) and head.bias is None \
            and _takes(head, self.dtype) and model.norm.weight.dtype == self.dtype \
            and model.norm.weight.is_contiguous() else None
        # ft_decode_layers' last arguments but the logits: (final norm, lm_head weight, its kind, its scales,
        # vocabulary)
        self._head_args = (None, None, 0, None, 0)
        if self.head is not None:
            w, scales = _weight(self.head)
            self._head_args = (model.norm.weight.data_ptr(), w.data_ptr(), _kind(w), _ptr(scales),
                               self.head.out_features)
        self.steps = 0  # pure-decode steps taken here (tests read it)

    def takes(self, num_rows: int) -> bool:
        """Would a pure-decode step of this many rows come here (the runner sets its threads by it)?"""
        return 0 < num_rows <= self.max_rows

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        return (self.takes(x.shape[0]) and meta.is_pure_decode and kv_caches[0].dtype == self.dtype
                and kv_caches[0].is_contiguous())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, with_head: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [M, hidden] contiguous in the model's dtype, the step's embeddings: overwritten with the last layer's
        output (the final norm is the caller's). cos, sin_rolled [M, head_dim] contiguous, the same dtype. Writes the
        rows' keys and values into ``kv_caches``. ``with_head`` (only where ``self.head`` is set): x is overwritten
        with the final norm's output instead, and the lm_head's logits [M, vocab] float32 come back beside it."""
        m = x.shape[0]
        kv = (ctypes.c_void_p * self.num_layers)(*(t.data_ptr() for t in kv_caches))
        seq_lens = (ctypes.c_int64 * m)(*meta.seq_lens)
        table, slots = meta.block_tables, meta.slot_mapping  # int32 [M, blocks], int64 [M]: AttentionMetadata.build
        logits = torch.empty(m, self.head.out_features, dtype=torch.float32) if with_head else None
        rc = self._fn(self._layers, self.num_layers, kv, kv_caches[0].stride(0), x.data_ptr(), m, self.hidden,
                      self.heads, self.kv_heads, self.head_dim, self.intermediate, self.eps, cos.data_ptr(),
                      sin_rolled.data_ptr(), table.data_ptr(), table.stride(0), seq_lens, slots.data_ptr(),
                      meta.block_size, self.scale, self.dtype == torch.bfloat16, kernel_threads(),
                      *(self._head_args if with_head else (None, None, 0, None, 0)), _ptr(logits))
        if rc != 0:
            raise MemoryError("fused decode layers: no scratch memory")
        self.steps += 1
        return x if logits is None else (x, logits)


def fused_decode_unsupported(model: nn.Module) -> str | None:
    """None when ``FusedDecoder`` takes this model's decode steps, else why not. The caller checked that the
    few-rows kernels are in use (``kernels_skipped``)."""
    from firsttoken.attention.sdpa import SdpaBackend

    if _kernel()[0] is None:
        return "the few-rows kernels are not built"
    c = getattr(model, "config", None)
    layers = getattr(model, "layers", None)
    if c is None or layers is None or not isinstance(getattr(model, "attn_backend", None), SdpaBackend):
        return "not a Qwen2VLModel decoder on the SDPA backend"
    if c.head_dim % 8 or c.head_dim > 512 or c.num_attention_heads % c.num_key_value_heads:
        return f"head_dim {c.head_dim} / heads {c.num_attention_heads}:{c.num_key_value_heads} unsupported"
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} activations (bfloat16 and float32 only)"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not _takes(lin, dtype):
                return "decoder weights the few-rows kernels do not take"
        if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None or attn.o_proj.bias is not None:
            return "biases outside qkv_proj unsupported"
        bias = attn.qkv_proj.bias
        if bias is not None and bias.dtype != torch.float32 and getattr(attn.qkv_proj, "bias32", None) is None:
            return "a bf16 qkv bias without its float32 copy (not a FewRowsLinear)"
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        norms += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
        if any(t.dtype != dtype or not t.is_contiguous() for t in norms):
            return f"norm weights are not {dtype}"
    return None


def use_fused_decode(model: nn.Module) -> str | None:
    """Give ``model`` a ``FusedDecoder`` for its pure-decode steps; returns None, or why not (nothing changed)."""
    reason = fused_decode_unsupported(model)
    if reason is None:
        model.fused_decode = FusedDecoder(model)
    return reason
