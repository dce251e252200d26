"""KV capacity planning from a checkpoint's shapes: how much KV one request holds, how many fit, which flags.

The arithmetic here is deliberately its own (it imports no engine, scheduler or kv code) so that the oracle
test can hold it against the real scheduler. It mirrors the scheduler's admission rule, stated here as the
contract this module plans for:

    a waiting request is admitted when the pool has ceil(min(prompt + decode_reserve, max_model_len) / block)
    free blocks (whole-prompt admission, prefix cache off), and grows one block per block_size decoded tokens.

So "fits" means: blocks for prompt + reserve, where prompt = text + images x image tokens + template overhead.
num_kv_blocks = kv_cache_memory_bytes // (kv_bytes_per_token x block_size), as the engine sizes its pool.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from firsttoken.units import parse_bytes  # noqa: F401  (re-exported: plan's CLI and tests take it from here)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# Qwen2-VL's chat template around one user turn with the default system prompt:
# "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" ... "<|im_end|>\n
# <|im_start|>assistant\n" is ~21 tokens with Qwen's tokenizer; each image adds <|vision_start|>, <|vision_end|>.
TEMPLATE_BASE_TOKENS = 21
TEMPLATE_TOKENS_PER_IMAGE = 2

def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- the checkpoint's shape ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What planning needs from config.json, read from either Qwen2-VL layout (flat or text_config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    vision_depth: int
    vision_width: int
    vision_mlp_width: int  # fc1 (Qwen2-VL) or gate/up (Qwen2.5-VL) width
    vision_gated_mlp: bool  # Qwen2.5-VL: gate/up/down with biases and RMSNorm; Qwen2-VL: fc1/fc2, LayerNorm
    vision_out_width: int
    vision_in_channels: int
    vision_patch_size: int
    vision_temporal_patch_size: int
    vision_spatial_merge_size: int

    @classmethod
    def from_config(cls, d: dict[str, Any]) -> "ModelShape":
        text = {**d, **d["text_config"]} if isinstance(d.get("text_config"), dict) else d
        v = d.get("vision_config") or {}
        model_type = str(d.get("model_type", "qwen2_vl"))
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        gated = "2_5" in model_type or "intermediate_size" in v and "mlp_ratio" not in v
        width = int(v.get("embed_dim") or (v.get("hidden_size") if gated else 1280) or 1280)
        mlp_width = int(v["intermediate_size"]) if gated else int(width * float(v.get("mlp_ratio", 4)))
        out_width = int(v.get("out_hidden_size") or (hidden if gated else v.get("hidden_size", hidden)))
        return cls(
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            vision_depth=int(v.get("depth", 32)),
            vision_width=width,
            vision_mlp_width=mlp_width,
            vision_gated_mlp=gated,
            vision_out_width=out_width,
            vision_in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            vision_patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
            vision_temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            vision_spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        )

    # ---- parameters, from shapes alone ---------------------------------------------------------------
    def language_model_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        attn = (h * q + q) + 2 * (h * kv + kv) + q * h  # q/k/v carry biases, o_proj does not
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * layer + h + lm_head

    def vision_params(self) -> int:
        e, m = self.vision_width, self.vision_mlp_width
        patch = self.vision_in_channels * self.vision_temporal_patch_size * self.vision_patch_size**2 * e
        norms = 2 * e if self.vision_gated_mlp else 4 * e  # RMSNorm weight vs LayerNorm weight + bias, x2
        attn = (e * 3 * e + 3 * e) + (e * e + e)
        mlp = (2 * (e * m + m) + (m * e + e)) if self.vision_gated_mlp else (e * m + m) + (m * e + e)
        merged = e * self.vision_spatial_merge_size**2
        merger = (e if self.vision_gated_mlp else 2 * e) + (merged * merged + merged)
        merger += merged * self.vision_out_width + self.vision_out_width
        return patch + self.vision_depth * (norms + attn + mlp) + merger

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token, all layers, GQA-aware: 2 x layers x KV heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def seed_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The incident review's formula: 2 x layers x attention heads x head_dim x bytes (ignores GQA)."""
        return 2 * self.num_layers * self.num_attention_heads * self.head_dim * dtype_bytes


def load_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def safetensors_weight_bytes(model_dir: str | Path) -> tuple[int, int] | None:
    """(parameters, bytes on disk) summed from the safetensors headers alone; None without .safetensors files."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    num_params = num_bytes = 0
    for f in files:
        with open(f, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in meta["shape"]:
                n *= dim
            num_params += n
            num_bytes += n * _SAFETENSORS_DTYPE_BYTES.get(meta["dtype"], 4)
    return num_params, num_bytes


# ---- the plan ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanInputs:
    kv_cache_memory_bytes: int  # the KV pool (firsttoken serve --kv-cache-memory), not the whole device
    peak_concurrency: int
    text_tokens: int = 800
    images_per_request: int = 3
    image_tokens: int = 1200  # per-image visual-token budget (--image-max-tokens)
    output_tokens: int = 256
    dtype: str = "bfloat16"
    block_size: int = 16
    decode_reserve_tokens: int = 64
    template_overhead_tokens: int | None = None  # None: TEMPLATE_BASE_TOKENS + 2 per image
    max_model_len: int | None = None  # None: prompt + output rounded up to a block

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("memory must be positive")
        if self.peak_concurrency < 1:
            raise ValueError("peak_concurrency must be >= 1")
        for name in ("text_tokens", "images_per_request", "image_tokens", "output_tokens", "decode_reserve_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def prompt_tokens(self) -> int:
        overhead = self.template_overhead_tokens
        if overhead is None:
            overhead = TEMPLATE_BASE_TOKENS + TEMPLATE_TOKENS_PER_IMAGE * self.images_per_request
        return self.text_tokens + self.images_per_request * self.image_tokens + overhead


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    model_type: str
    # weights
    num_params: int  # from config shapes
    num_params_language_model: int
    num_params_vision: int
    weights_bytes: int  # num_params x dtype bytes
    safetensors_params: int | None  # summed from safetensors headers when the model dir has them
    safetensors_bytes: int | None
    # per token
    kv_bytes_per_token: int  # 2 x layers x KV heads x head_dim x bytes
    seed_kv_bytes_per_token: int  # 2 x layers x attention heads x head_dim x bytes
    seed_overstatement: float  # seed / GQA-aware = attention heads / KV heads
    # per request
    prompt_tokens: int
    max_model_len: int
    admission_blocks_per_request: int  # ceil(min(prompt + reserve, max_model_len) / block)
    admission_kv_bytes_per_request: int
    full_blocks_per_request: int  # ceil((prompt + output) / block): the request at its last token
    full_kv_bytes_per_request: int
    # pool
    num_kv_blocks: int  # kv memory // (kv bytes per token x block)
    pool_bytes_to_admit_peak: int  # peak x admission blocks
    pool_bytes_for_peak_without_preemption: int  # peak x full blocks
    # answers
    max_concurrency: int  # requests admitted at once with this pool (what the scheduler does)
    max_concurrency_without_preemption: int  # requests that can all run to their last token
    max_prompt_tokens_at_peak: int  # largest prompt that still admits peak_concurrency requests
    max_images_at_peak: int  # images of image_tokens each that fit beside text_tokens at the peak
    fits: bool  # max_concurrency >= peak_concurrency
    serve_flags: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(config: dict[str, Any], inputs: PlanInputs, model_dir: str | Path | None = None) -> Plan:
    shape = ModelShape.from_config(config)
    dtype_bytes = DTYPE_BYTES[inputs.dtype]
    bs = inputs.block_size
    lm, vision = shape.language_model_params(), shape.vision_params()
    st = safetensors_weight_bytes(model_dir) if model_dir is not None else None

    kv_tok = shape.kv_bytes_per_token(dtype_bytes)
    seed_tok = shape.seed_kv_bytes_per_token(dtype_bytes)
    prompt = inputs.prompt_tokens
    max_model_len = inputs.max_model_len or _ceil_div(prompt + inputs.output_tokens, bs) * bs
    admit_blocks = _ceil_div(min(prompt + inputs.decode_reserve_tokens, max_model_len), bs)
    full_blocks = _ceil_div(min(prompt + inputs.output_tokens, max_model_len), bs)
    block_bytes = kv_tok * bs
    num_blocks = inputs.kv_cache_memory_bytes // block_bytes

    blocks_each_at_peak = num_blocks // inputs.peak_concurrency
    max_prompt = max(0, blocks_each_at_peak * bs - inputs.decode_reserve_tokens)
    # Images that fit beside the text at the peak: each costs its budget plus its template tokens
    # (an explicit template overhead is taken as fixed).
    per_image_overhead = TEMPLATE_TOKENS_PER_IMAGE if inputs.template_overhead_tokens is None else 0
    fixed = prompt - inputs.images_per_request * (inputs.image_tokens + per_image_overhead)
    per_image = inputs.image_tokens + per_image_overhead
    max_images = max(0, (max_prompt - fixed) // per_image) if per_image else 0

    max_conc = num_blocks // admit_blocks if admit_blocks else 0
    peak_pool_bytes = inputs.peak_concurrency * admit_blocks * block_bytes
    flags = {
        "--kv-cache-memory": _flag_bytes(inputs.kv_cache_memory_bytes),
        "--max-model-len": str(max_model_len),
        "--image-max-tokens": str(inputs.image_tokens),
        "--max-batched-tokens": str(max(2048, _ceil_div(inputs.image_tokens + inputs.peak_concurrency, 256) * 256)),
        "--max-num-seqs": str(max(1, min(max_conc, inputs.peak_concurrency))),
        "--block-size": str(bs),
        "--decode-reserve-tokens": str(inputs.decode_reserve_tokens),
        "--dtype": inputs.dtype,
    }
    return Plan(
        inputs=inputs,
        model_type=shape.model_type,
        num_params=lm + vision,
        num_params_language_model=lm,
        num_params_vision=vision,
        weights_bytes=(lm + vision) * dtype_bytes,
        safetensors_params=st[0] if st else None,
        safetensors_bytes=st[1] if st else None,
        kv_bytes_per_token=kv_tok,
        seed_kv_bytes_per_token=seed_tok,
        seed_overstatement=seed_tok / kv_tok,
        prompt_tokens=prompt,
        max_model_len=max_model_len,
        admission_blocks_per_request=admit_blocks,
        admission_kv_bytes_per_request=admit_blocks * block_bytes,
        full_blocks_per_request=full_blocks,
        full_kv_bytes_per_request=full_blocks * block_bytes,
        num_kv_blocks=num_blocks,
        pool_bytes_to_admit_peak=peak_pool_bytes,
        pool_bytes_for_peak_without_preemption=inputs.peak_concurrency * full_blocks * block_bytes,
        max_concurrency=max_conc,
        max_concurrency_without_preemption=num_blocks // full_blocks if full_blocks else 0,
        max_prompt_tokens_at_peak=min(max_prompt, shape.max_position_embeddings),
        max_images_at_peak=max_images,
        fits=max_conc >= inputs.peak_concurrency,
        serve_flags=flags,
    )


def _flag_bytes(n: int) -> str:
    return f"{n // 2**30}GiB" if n % 2**30 == 0 else (f"{n // 2**20}MiB" if n % 2**20 == 0 else str(n))


def format_plan(plan: Plan) -> str:
    i = plan.inputs
    rows: list[tuple[str, str]] = [
        ("model", f"{plan.model_type}, {i.dtype}, block {i.block_size} tokens"),
        ("parameters (from config shapes)",
         f"{plan.num_params:,} = {plan.num_params_language_model:,} LM + {plan.num_params_vision:,} vision"),
        ("weights in memory", format_bytes(plan.weights_bytes)),
    ]
    if plan.safetensors_params is not None:
        rows.append(("safetensors headers", f"{plan.safetensors_params:,} params, "
                     f"{format_bytes(plan.safetensors_bytes or 0)} on disk"))
    rows += [
        ("KV bytes / token (GQA: 2 x L x KV heads x hd x B)", f"{plan.kv_bytes_per_token:,} B"),
        ("seed formula (2 x L x attn heads x hd x B)",
         f"{plan.seed_kv_bytes_per_token:,} B  ({plan.seed_overstatement:.1f}x overstated)"),
        ("prompt tokens / request",
         f"{plan.prompt_tokens:,} = {i.text_tokens} text + {i.images_per_request} x {i.image_tokens} image "
         f"+ {plan.prompt_tokens - i.text_tokens - i.images_per_request * i.image_tokens} template"),
        ("KV at admission (prompt + reserve)",
         f"{plan.admission_blocks_per_request} blocks = {format_bytes(plan.admission_kv_bytes_per_request)}"),
        ("KV at last token (prompt + output)",
         f"{plan.full_blocks_per_request} blocks = {format_bytes(plan.full_kv_bytes_per_request)}"),
        ("KV pool", f"{format_bytes(i.kv_cache_memory_bytes)} = {plan.num_kv_blocks:,} blocks"),
        (f"pool to admit the peak ({i.peak_concurrency})", format_bytes(plan.pool_bytes_to_admit_peak)),
        ("pool for the peak to finish without preemption",
         format_bytes(plan.pool_bytes_for_peak_without_preemption)),
        ("max concurrency (admitted at once)", f"{plan.max_concurrency}"
         + ("" if plan.fits else f"  < peak {i.peak_concurrency}: DOES NOT FIT")),
        ("max concurrency without preemption", str(plan.max_concurrency_without_preemption)),
        (f"largest prompt at peak {i.peak_concurrency}", f"{plan.max_prompt_tokens_at_peak:,} tokens "
         f"(= {plan.max_images_at_peak} images of {i.image_tokens} beside {i.text_tokens} text tokens)"),
        ("weights + KV pool", format_bytes(plan.weights_bytes + i.kv_cache_memory_bytes)
         + " (+ activations, vision tower workspace, encoder cache)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append("firsttoken serve " + " ".join(f"{k} {v}" for k, v in plan.serve_flags.items()))
    return "\n".join(lines)
