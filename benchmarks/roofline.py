"""A roofline for one prefill: FLOPs of each part (from the config and the prompt), its measured seconds in our
model code, achieved GFLOP/s and % of this machine's measured matmul peak, and its share of the prefill's time.

    python benchmarks/roofline.py [--model DIR] [--image 1024x1024 ...] [--text-tokens 800] [--dtype float32]
                                  [--quantization none|fp16|int8] [--chunk-tokens server|0|N] [--threads 2]
                                  [--repeats 3] [--json OUT]

The prefill is what the runner does for a request's first token: vision tower per image through the encode
protocol (``start_encode``: patch embed; ``run_units`` over the family's encoder units: the blocks, a large image's
in query-row slices; ``finish_encode``: merger), then the language model over the paged KV cache through the SDPA
backend (token embeddings with the image rows placed, ``ImageRows`` per chunk), and the lm_head on the one sampled
row. Qwen2-VL checkpoints only (the FLOP count and the hooks follow its tower). ``--chunk-tokens server``
(default) splits the language model's pass as `firsttoken serve` does by default: whole below
--long-prompt-threshold (1,024 tokens), else long-lane steps of 512 tokens whose later chunks read earlier
keys/values from the cache; 0 = one pass.

Parts are timed during real prefills with forward hooks (PyTorch's public API) on the model's modules and an
attention backend wrapper passed to ``load_model`` (its designed seam); nothing in firsttoken changes. A part's
seconds are wall time inside its modules, so "other" parts hold what sits between the matmuls (norms, rotary,
activations, residual adds, reshapes). A sliced vision block never calls its attention module's forward (the
slices call its ``project`` and ``attend``), so vision attention is the blocks' time less their linears, norms
and MLP activation: SDPA, rotary, reshapes and the blocks' residual adds. The prefill total comes from runs
without hooks, alternating with the hooked ones. Every time is the best of --repeats runs (load from other
processes only adds time).

FLOPs count a multiply-add as 2 and only useful work: causal attention counts the keys each query may see;
norms, rotary and activations count 0 (they are "other": memory-bound work with no matmul peak to compare).
Peak: the best GFLOP/s that a 2048x2048x2048 matmul (measured between the prefill runs) or one of the model's own
GEMM shapes reached at --threads, in --dtype; load from other processes only lowers a rate, so the best is the
estimate. A part timed inside the model in a quieter moment can still exceed it on a shared machine. bf16 is
measured only where the CPU computes it natively (avx512_bf16 / amx_bf16); elsewhere torch emulates it slower than
fp32.

``--quantization`` (float32 only) loads the model as the server's flag does (loading/quant.py): int8 turns every
linear layer but the patch embedding into int8 (per-row weights and inputs, int32 products), fp16 the language
model's (lm_head included) into packed float16 weights. FLOPs are counted the same; % of peak stays against the
float32 peak, and each row is labelled with the weights its modules actually hold ([int8], [fp16]), so an int8 row
above 100% is the integer GEMM's gain. The quantized GEMM's own 2048^3 rate is printed beside the peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from firsttoken.attention.base import AttentionBackend, AttentionMetadata
from firsttoken.attention.registry import get_backend
from firsttoken.config import QUANTIZATIONS, SchedulerConfig
from firsttoken.inputs.budget import REFERENCE_MAX_TOKENS, REFERENCE_MIN_TOKENS, plan_image
from firsttoken.inputs.image import ProcessedImage, preprocess_image
from firsttoken.kernels.cpu_features import CpuFeatures
from firsttoken.kernels.cpu_linear import built_kernels
from firsttoken.loading.loader import load_model
from firsttoken.loading.quant import Fp16Weights, Int8Weights, int_mm_exact
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.interfaces import ImageEmbeddings, ImageRows
from firsttoken.models.linear import Linear
from firsttoken.models.mrope import compute_mrope_positions
from firsttoken.models.registry import load_model_config
from firsttoken.runner.kv_cache import allocate_kv_caches
from firsttoken.tools.bench.images import synth_image

BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PEAK_SIDE = 2048
# (part, what its seconds cover); FLOPs of the "other" parts are 0 by definition
PARTS = (
    ("patch_embed", "Linear over flattened 14x14x2x3 patches"),
    ("vision_linear", "vision blocks' qkv, proj, fc1, fc2"),
    ("vision_attention", "vision SDPA + rotary + reshapes + residual adds (blocks minus linears, norms, GELU)"),
    ("vision_other", "vision rotary tables, LayerNorms, GELU"),
    ("merger", "LayerNorm + 2x2 merge MLP"),
    ("inputs", "token embeddings, image rows per chunk, M-RoPE positions, attention metadata"),
    ("lm_linear", "LM qkv_proj, o_proj, gate_up_proj, down_proj"),
    ("lm_attention", "LM KV-cache write + causal SDPA (the attention backend)"),
    ("lm_other", "LM image rows placed, rotary tables, RMSNorms, rotary, SiLU*up, residual adds"),
    ("lm_head", "lm_head on the sampled row"),
)
LINEAR_PARTS = ("patch_embed", "vision_linear", "merger", "lm_linear", "lm_head")
QUANT_GEMMS = {"int8": "the int8 linear layer (per-row inputs, torch._int_mm)", "fp16": "FBGEMM's float16-weight GEMM"}


# ---- the prompt ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: list[ProcessedImage]
    chunks: list[tuple[int, int]]  # [start, end) token ranges of the LM's passes

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        return [im.grid_thw for im in self.images]


def build_prompt(config: ModelConfig, sizes: list[tuple[int, int]], text_tokens: int, image_max_tokens: int,
                 chunk_tokens: int | None) -> Prompt:  # fmt: skip
    """Text (random ids) split around the images, each image in vision start/end markers; chunk_tokens None =
    the server's default split."""
    images = []
    proc = config.image_processor
    for i, (w, h) in enumerate(sizes):
        plan = plan_image(w, h, image_max_tokens, REFERENCE_MIN_TOKENS, proc)
        images.append(preprocess_image(synth_image(w, h, f"roofline:{i}"), proc, plan.min_pixels,
                                       plan.max_pixels))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, min(config.vocab_size, 1000), (text_tokens,), generator=gen).tolist()
    half = text_tokens // 2
    ids = text[:half]
    for im in images:
        ids += [config.vision_start_token_id] + [config.image_token_id] * im.num_tokens + [config.vision_end_token_id]
    ids += text[half:]
    if chunk_tokens is None:
        sched = SchedulerConfig()
        chunk_tokens = 0 if len(ids) < sched.long_prompt_threshold else sched.long_step_tokens
    step = chunk_tokens or len(ids)
    chunks = [(s, min(s + step, len(ids))) for s in range(0, len(ids), step)]
    return Prompt(ids, images, chunks)


# ---- FLOPs -------------------------------------------------------------------------------------------------------
def count_flops(config: ModelConfig, prompt: Prompt) -> dict[str, float]:
    """Useful FLOPs per part (multiply-add = 2)."""
    v = config.vision
    e, mlp = v.embed_dim, v.intermediate_size
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    merged = e * v.spatial_merge_size**2
    flops: dict[str, float] = defaultdict(float)
    for t, h, w in prompt.grids:
        n = t * h * w  # patches
        flops["patch_embed"] += 2 * n * patch_dim * e
        flops["vision_linear"] += v.depth * 2 * n * e * (3 * e + e + mlp + mlp)
        flops["vision_attention"] += v.depth * 4 * n * n * e  # QK^T and AV, full attention within the image
        tokens = n // v.spatial_merge_size**2
        flops["merger"] += 2 * tokens * merged * (merged + v.out_hidden_size)
    hd, nh, nkv, hid = config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    per_token = 2 * hid * (nh * hd + 2 * nkv * hd) + 2 * nh * hd * hid + 2 * hid * 3 * config.intermediate_size
    pairs = sum((e_ - s) * s + (e_ - s) * (e_ - s + 1) // 2 for s, e_ in prompt.chunks)  # causal (query, key)
    flops["lm_linear"] = config.num_hidden_layers * per_token * len(prompt.ids)
    flops["lm_attention"] = config.num_hidden_layers * 4 * nh * hd * pairs
    flops["lm_head"] = 2 * hid * config.vocab_size
    return {name: flops.get(name, 0.0) for name, _ in PARTS}


# ---- timing ------------------------------------------------------------------------------------------------------
class PartClock:
    """Wall seconds per part, from forward pre/post hooks; ``group`` names are parts or scratch totals."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: dict[int, float] = {}
        self._handles: list = []

    def watch(self, module: nn.Module, group: str) -> None:
        def pre(mod: nn.Module, _args) -> None:
            self._open[id(mod)] = time.perf_counter()

        def post(mod: nn.Module, _args, _out) -> None:
            self.seconds[group] += time.perf_counter() - self._open.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    @contextmanager
    def span(self, group: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[group] += time.perf_counter() - start

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class TimedBackend:
    """An attention backend that times the one it wraps (load_model's attn_backend seam) while a clock is set."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = f"timed-{inner.name}"
        self.clock: PartClock | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
        if self.clock is None:
            return self.inner.forward(q, k, v, kv_cache, meta, scale)
        with self.clock.span("lm_attention"):
            return self.inner.forward(q, k, v, kv_cache, meta, scale)


LINEAR_MODULES = (nn.Linear,)  # what load_model leaves at a linear layer's place (models/linear.py's Linear)


def linear_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules doing each linear part's products, whatever method quantization gave them (int8 and fp16 ones
    hold no ``.weight``); found by their place in the model, not by type, and checked so a refactor that moves
    them fails loudly instead of timing nothing."""
    vis = model.visual
    parts = {
        "patch_embed": [vis.patch_embed.proj],
        "_vision_attn_linear": [m for b in vis.blocks for m in (b.attn.qkv, b.attn.proj)],
        "_vision_mlp_linear": [m for b in vis.blocks for m in (b.mlp.fc1, b.mlp.fc2)],
        "merger": [m for m in vis.merger.mlp if isinstance(m, LINEAR_MODULES)],
        "lm_linear": [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                           layer.mlp.gate_up_proj, layer.mlp.down_proj)],
        "lm_head": [model.lm_head],  # tied: it reads the embeddings
    }  # fmt: skip
    for name, mods in parts.items():
        for m in mods:
            if not isinstance(m, LINEAR_MODULES):
                raise TypeError(f"{name}: {type(m).__name__} is not a linear layer this script knows")
    return parts


def weights_of(model: nn.Module, dtype: str) -> dict[str, str]:
    """Per linear part, what its products ran with: ``dtype`` (a float weight), "int8" or "fp16" (or a mix)."""

    def kind(m: nn.Module) -> str:
        method = getattr(m, "method", None)
        return "int8" if isinstance(method, Int8Weights) else "fp16" if isinstance(method, Fp16Weights) else dtype

    mods = linear_modules(model)
    out = {}
    for part in LINEAR_PARTS:
        found = mods["_vision_attn_linear"] + mods["_vision_mlp_linear"] if part == "vision_linear" else mods[part]
        out[part] = "+".join(sorted({kind(m) for m in found})) or dtype  # a tied lm_head: the embeddings' dtype
    return out


def watch_model(model: nn.Module, clock: PartClock) -> None:
    """Hooks per part; groups starting with "_" are enclosing totals that _split turns into parts. The vision
    encode's own spans ("_visual", "_vision_blocks") and the LM forward's ("_lm_forward") come from prefill."""
    linears = linear_modules(model)  # the merger and lm_head are timed whole (a module hook, prefill's span)
    for group in ("patch_embed", "_vision_attn_linear", "_vision_mlp_linear", "lm_linear"):
        for m in linears[group]:
            clock.watch(m, group)
    vis = model.visual
    clock.watch(vis.merger, "merger")  # its LayerNorm and GELU too
    for block in vis.blocks:
        clock.watch(block.norm1, "_vision_norms")
        clock.watch(block.norm2, "_vision_norms")
        clock.watch(block.mlp, "_vision_mlp")
    clock.watch(model.embed_tokens, "_lm_embed")


def encode(model: nn.Module, image: ProcessedImage, span: Callable[[str], object]) -> ImageEmbeddings:
    """One image through the vision tower as the runner's ``_run_encoder`` drives it, all its units in one go."""
    visual = model.visual
    with span("_visual"):
        pixels = image.pixel_values.to(device=_device_of(model), dtype=model.dtype)
        state = visual.start_encode(pixels, image.grid_thw)
        with span("_vision_blocks"):
            visual.run_units(state, state.num_units)
        return visual.finish_encode(state)


def prefill(model: nn.Module, config: ModelConfig, prompt: Prompt, clock: PartClock | None) -> torch.Tensor:
    """One request's prefill to its first-token logits, as the runner does it (encode, LM chunks with their image
    rows, head)."""
    span = clock.span if clock else _no_span
    with torch.inference_mode():
        embeds = [encode(model, im, span) for im in prompt.images]
        return lm_prefill(model, config, prompt, embeds, span)


def lm_prefill(model: nn.Module, config: ModelConfig, prompt: Prompt, embeds: list[ImageEmbeddings],
               span: Callable[[str], object] = lambda _group: nullcontext()) -> torch.Tensor:  # fmt: skip
    """The language model's part of ``prefill``: the prompt's chunks over a fresh paged KV cache on the model's
    device, each image's rows (``embeds``, in prompt order) placed, then the head on the last row."""
    device = _device_of(model)
    num_blocks = -(-len(prompt.ids) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, model.dtype, device)
    with torch.inference_mode():
        with span("inputs"):
            input_ids = torch.tensor(prompt.ids, device=device)
            positions = compute_mrope_positions(prompt.ids, prompt.grids, config).positions.to(device)
            offsets, at = [], 0  # each image's first pad token
            for im in prompt.images:
                at = prompt.ids.index(config.image_token_id, at)
                offsets.append(at)
                at += im.num_tokens
        table = [list(range(num_blocks))]
        for start, end in prompt.chunks:
            with span("inputs"):
                meta = AttentionMetadata.build([end - start], [start], table, BLOCK_SIZE, device=device)
                rows = []  # the image rows this chunk covers, as the runner's _pack places them
                for off, emb in zip(offsets, embeds):
                    lo, hi = max(off, start), min(off + emb.num_tokens, end)
                    if lo < hi:
                        rows.append(ImageRows(lo - start, emb.rows(lo - off, hi - off)))
            with span("_lm_forward"):
                hidden = model(input_ids[start:end], positions[:, start:end], kv_caches, meta, rows)
        with span("lm_head"):
            return model.compute_logits(hidden[-1:])


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextmanager
def _no_span(_group: str) -> Iterator[None]:
    yield


def time_parts(model: nn.Module, config: ModelConfig, prompt: Prompt, backend: TimedBackend, repeats: int,
               between: Callable[[], object]) -> tuple[dict[str, float], float]:  # fmt: skip
    """(best seconds per part over the hooked runs, best total seconds over the hook-free runs) after one warm-up,
    hook-free and hooked runs alternating, ``between()`` after each pair (the peak measurement, so it samples
    the same stretch of time). Best, not median: load from other processes on a shared machine only ever adds
    time, so the fastest run is the closest to what the code costs here."""
    prefill(model, config, prompt, None)
    totals: list[float] = []
    runs: list[dict[str, float]] = []
    for _ in range(repeats):
        between()
        start = time.perf_counter()
        prefill(model, config, prompt, None)
        totals.append(time.perf_counter() - start)
        clock = PartClock()
        watch_model(model, clock)
        backend.clock = clock
        try:
            start = time.perf_counter()
            prefill(model, config, prompt, clock)
            runs.append(_split(clock.seconds, time.perf_counter() - start))
        finally:
            clock.remove()
            backend.clock = None
    return {name: min(r[name] for r in runs) for name in runs[0]}, min(totals)


def _split(s: dict[str, float], wall: float) -> dict[str, float]:
    """Raw hook totals -> the PARTS: an "other" part is what its enclosing modules spent outside the parts
    inside them (vision: rotary tables, norms, GELU; LM: image rows placed, norms, rotary, SiLU, residuals)."""
    parts = {name: s.get(name, 0.0) for name, _ in PARTS}
    attn_linear, mlp_linear = s.get("_vision_attn_linear", 0.0), s.get("_vision_mlp_linear", 0.0)
    blocks, norms, mlp = s.get("_vision_blocks", 0.0), s.get("_vision_norms", 0.0), s.get("_vision_mlp", 0.0)
    parts["vision_linear"] = attn_linear + mlp_linear
    parts["vision_attention"] = max(0.0, blocks - norms - mlp - attn_linear)
    outside_blocks = s.get("_visual", 0.0) - blocks - parts["patch_embed"] - parts["merger"]
    parts["vision_other"] = max(0.0, outside_blocks + norms + mlp - mlp_linear)
    embed = s.get("_lm_embed", 0.0)
    parts["inputs"] += embed
    lm_forward = s.get("_lm_forward", 0.0)
    parts["lm_other"] = max(0.0, lm_forward - embed - s.get("lm_linear", 0.0) - s.get("lm_attention", 0.0))
    parts["_hooked_wall"] = wall
    return parts


# ---- peak --------------------------------------------------------------------------------------------------------
def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5, min_s: float = 0.2) -> float:
    """Best GFLOP/s of [m, k] rows through a [n, k] weight, as nn.Linear runs it (F.linear, no bias), over
    ``repeats`` timed batches of >= min_s each."""
    x, weight = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    return _best_gflops(lambda: F.linear(x, weight), 2 * m * k * n, repeats, min_s)


def quantized_gflops(m: int, k: int, n: int, kind: str, threads: int, repeats: int = 5, min_s: float = 0.2) -> float:
    """The same for load_model's quantized linear layer ``kind`` ("int8": Int8Weights, "fp16": Fp16Weights as the
    server builds it at --threads), float32 [m, k] rows in; FLOPs counted as float32's."""
    weight = torch.randn(n, k)
    method = Int8Weights(built_kernels(), int_mm_exact(CpuFeatures.detect())) if kind == "int8" \
        else Fp16Weights(multithreaded=threads != 1)
    layer = Linear.of(weight, None, method)
    x = torch.randn(m, k)
    with torch.inference_mode():
        return _best_gflops(lambda: layer(x), 2 * m * k * n, repeats, min_s)


def _best_gflops(call: Callable[[], object], flop: int, repeats: int, min_s: float) -> float:
    call()
    best = 0.0
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_s or calls == 0:
            call()
            calls += 1
        best = max(best, flop * calls / elapsed / 1e9)
    return best


def model_shapes(config: ModelConfig, prompt: Prompt) -> dict[str, tuple[int, int, int]]:
    """The model's GEMMs at this prompt: name -> (m, k, n), m = rows (patches or tokens in one pass)."""
    v = config.vision
    n = max((t * h * w for t, h, w in prompt.grids), default=0)
    m = max(e - s for s, e in prompt.chunks)
    hid, hd = config.hidden_size, config.head_dim
    shapes = {
        "lm qkv_proj": (m, hid, (config.num_attention_heads + 2 * config.num_key_value_heads) * hd),
        "lm o_proj": (m, config.num_attention_heads * hd, hid),
        "lm gate_up_proj": (m, hid, 2 * config.intermediate_size),
        "lm down_proj": (m, config.intermediate_size, hid),
    }
    if n:
        e, mlp = v.embed_dim, v.intermediate_size
        shapes |= {
            "patch_embed": (n, v.in_channels * v.temporal_patch_size * v.patch_size**2, e),
            "vision qkv": (n, e, 3 * e),
            "vision fc1": (n, e, mlp),
            "vision fc2": (n, mlp, e),
        }
    return shapes


# ---- report ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartRow:
    part: str
    covers: str
    gflop: float
    seconds: float
    gflops: float | None  # achieved GFLOP/s (None for parts with no counted FLOPs)
    pct_of_peak: float | None
    share_of_time: float
    weights: str | None = None  # linear parts: what their products ran with (--dtype, "int8", "fp16")


def rows_for(flops: dict[str, float], seconds: dict[str, float], wall_s: float, peak: float,
             weights: dict[str, str]) -> list[PartRow]:  # fmt: skip
    """Per part; its share is of the parts' sum (each part's best comes from its own fastest run)."""
    rows = []
    for name, covers in PARTS:
        s, f = seconds[name], flops[name]
        rate = f / s / 1e9 if f and s else None
        rows.append(PartRow(name, covers, f / 1e9, s, rate, rate / peak if rate else None, s / wall_s,
                            weights.get(name)))  # fmt: skip
    return rows


def label(part: str, weights: str | None, dtype: str) -> str:
    """A part's name, with its weights' kind in brackets where they are not --dtype (a quantized part)."""
    return part if weights in (None, dtype) else f"{part} [{weights}]"


def aggregate(rows: list[PartRow], names: tuple[str, ...] | None, total_s: float, peak: float) -> dict[str, float]:
    picked = [r for r in rows if names is None or r.part in names]
    gflop = sum(r.gflop for r in picked)
    seconds = total_s if names is None else sum(r.seconds for r in picked)
    return {"gflop": gflop, "seconds": seconds, "gflops": gflop / seconds, "pct_of_peak": gflop / seconds / peak}


def print_report(result: dict) -> None:
    m, p = result["machine"], result["prompt"]
    print(f"CPU {m['cpu']}, {m['cores']} cores, flags {' '.join(m['cpu_flags']) or '-'}; threads {result['threads']}; "
          f"load {m['loadavg']}")  # fmt: skip
    quant, dtype = result["quantization"], result["dtype"]
    print(f"prompt: {p['tokens']} tokens ({p['text_tokens']} text, {p['visual_tokens']} visual from "
          f"{p['images']}), LM passes {p['chunks']}; dtype {dtype}; quantization {quant}; "
          f"best of {result['repeats']}")  # fmt: skip
    peak = result["peak"]
    print(f"matmul peak ({dtype}, best of {PEAK_SIDE}^3 and the model's shapes): {peak['gflops']:.1f} "
          f"GFLOP/s ({PEAK_SIDE}^3: {peak['square_gflops']:.1f})"
          + (f"; bf16 {peak['bf16_gflops']:.1f}" if peak.get("bf16_gflops") else f"; bf16: {peak['bf16_note']}"))
    if quant != "none":
        rate = peak[f"{quant}_gflops"]
        print(f"{quant} linear layer ({QUANT_GEMMS[quant]}) at {PEAK_SIDE}^3: {rate:.1f} GFLOP/s "
              f"({rate / peak['gflops']:.0%} of the {dtype} peak); rows marked [{quant}] ran it, their % peak is "
              f"against the {dtype} peak")  # fmt: skip
    for name, (shape, rate) in result["shapes"].items():
        print(f"  {name:16s} {'x'.join(map(str, shape)):>16s}  {rate:7.1f} GFLOP/s ({rate / peak['gflops']:.0%})")
    labels = [label(r["part"], r["weights"], dtype) for r in result["rows"]]
    lm_label = label("LM linear layers", next(r["weights"] for r in result["rows"] if r["part"] == "lm_linear"),
                     dtype)  # fmt: skip
    width = max(18, *(len(x) + 2 for x in (*labels, lm_label)))
    print(f"\n{'part':{width}s}{'GFLOP':>9s}{'seconds':>9s}{'GFLOP/s':>9s}{'% peak':>8s}{'% time':>8s}  covers")
    for name, r in zip(labels, result["rows"]):
        rate = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        pct = "-" if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.0%}"
        print(f"{name:{width}s}{r['gflop']:9.2f}{r['seconds']:9.3f}{rate:>9s}{pct:>8s}{r['share_of_time']:8.0%}  "
              f"{r['covers']}")  # fmt: skip
    for name, key, target in ((lm_label, "lm_linear", 0.6), ("whole prefill", "total", 0.4)):
        a = result["aggregates"][key]
        verdict = "met" if a["pct_of_peak"] >= target else "MISS"
        print(f"{name:{width}s}{a['gflop']:9.2f}{a['seconds']:9.3f}{a['gflops']:9.1f}{a['pct_of_peak']:8.0%}"
              f"          target >= {target:.0%}: {verdict}")  # fmt: skip
    parts_s = sum(r["seconds"] for r in result["rows"])
    print(f"(whole prefill: best hook-free run {result['hook_free_s']:.3f} s; best hooked run "
          f"{result['hooked_wall_s']:.3f} s; sum of the parts' bests {parts_s:.3f} s)")


def parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    if not (w.isdigit() and h.isdigit()) or int(w) < 1 or int(h) < 1:
        raise argparse.ArgumentTypeError(f"image size must be WIDTHxHEIGHT, got {text!r}")
    return int(w), int(h)


def parse_chunk(text: str) -> int | None:
    if text == "server":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--chunk-tokens must be 'server' or a count >= 0, got {text!r}")
    return int(text)


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    config = load_model_config(model_dir)
    if config.family != "qwen2-vl":
        raise SystemExit(f"{model_dir} is a {config.family} checkpoint; roofline.py counts and hooks Qwen2-VL's parts")
    backend = TimedBackend(get_backend("sdpa"))
    model = load_model(model_dir, dtype, attn_backend=backend, quantization=args.quantization,
                       num_threads=args.threads)  # fmt: skip
    weights = weights_of(model, args.dtype)
    sizes = args.image if args.image is not None else [(1024, 1024)]
    prompt = build_prompt(config, sizes, args.text_tokens, args.image_max_tokens, args.chunk_tokens)
    flops = count_flops(config, prompt)
    cube = (PEAK_SIDE, PEAK_SIDE, PEAK_SIDE)
    squares: list[float] = []
    seconds, total_s = time_parts(model, config, prompt, backend, args.repeats,
                                  lambda: squares.append(matmul_gflops(*cube, dtype)))  # fmt: skip
    squares.append(matmul_gflops(*cube, dtype))
    shapes = {name: (shape, matmul_gflops(*shape, dtype)) for name, shape in model_shapes(config, prompt).items()}
    # Other load only ever lowers a rate, so the peak is the best any measured matmul reached during the run.
    peak = {"gflops": max(*squares, *(rate for _, rate in shapes.values())), "square_gflops": max(squares)}
    if CpuFeatures.detect().native_bf16:
        peak["bf16_gflops"] = matmul_gflops(*cube, torch.bfloat16)
    else:
        peak["bf16_note"] = "not native on this CPU (no avx512_bf16/amx_bf16): not measured"
    if args.quantization != "none":  # what the quantized rows' own GEMM reaches (the reference stays float32)
        peak[f"{args.quantization}_gflops"] = quantized_gflops(*cube, args.quantization, args.threads)
    rows = rows_for(flops, seconds, sum(seconds[name] for name, _ in PARTS), peak["gflops"], weights)
    # hooks add no measurable time (the parts add up to the hooked wall), so the fastest run of either kind counts
    whole_s = min(total_s, seconds["_hooked_wall"])
    visual = sum(im.num_tokens for im in prompt.images)
    return {
        "machine": machine_info(), "threads": args.threads, "dtype": args.dtype,
        "quantization": args.quantization, "weights": weights, "repeats": args.repeats, "model": str(model_dir),
        "prompt": {"tokens": len(prompt.ids), "text_tokens": args.text_tokens, "visual_tokens": visual,
                   "images": [f"{w}x{h}" for w, h in sizes], "grids": prompt.grids,
                   "chunks": [e - s for s, e in prompt.chunks]},
        "peak": peak, "shapes": shapes, "rows": [asdict(r) for r in rows], "total_s": whole_s,
        "hook_free_s": total_s,
        "hooked_wall_s": seconds.get("_hooked_wall", 0.0),
        "aggregates": {"lm_linear": aggregate(rows, ("lm_linear",), total_s, peak["gflops"]),
                       "linear": aggregate(rows, LINEAR_PARTS, total_s, peak["gflops"]),
                       "total": aggregate(rows, None, whole_s, peak["gflops"])},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build 'small' in a temp dir)")
    p.add_argument("--image", type=parse_size, action="append", default=None,
                   help="an image of WIDTHxHEIGHT (repeat for more; default one 1024x1024)")  # fmt: skip
    p.add_argument("--no-image", dest="image", action="store_const", const=[], help="a text-only prompt")
    p.add_argument("--text-tokens", type=int, default=800)
    p.add_argument("--image-max-tokens", type=int, default=REFERENCE_MAX_TOKENS,
                   help="visual tokens per image at most (default %(default)s: no budget, 1,369 per 1024x1024)")
    p.add_argument("--chunk-tokens", type=parse_chunk, default=None, help="'server' (default), 0 = one LM pass, N")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="as `firsttoken serve --quantization` (loading/quant.py); needs --dtype float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quantization != "none" and args.dtype != "float32":
        p.error(f"--quantization {args.quantization} runs float32 activations: use --dtype float32")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from firsttoken.models.checkpoint import make_model

            model_dir = make_model(Path(tmp) / "small", size="small")
        else:
            model_dir = args.model
        result = run(args, model_dir)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
