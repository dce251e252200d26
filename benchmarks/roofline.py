"""A roofline for one prefill: FLOPs of each part (from the config and the prompt), its measured seconds in our
model code, achieved GFLOP/s and % of this machine's measured matmul peak, and its share of the prefill's time.

    python benchmarks/roofline.py [--model DIR] [--image 1024x1024 ...] [--text-tokens 800] [--dtype float32]
                                  [--chunk-tokens server|0|N] [--threads 2] [--repeats 3] [--json OUT]

The prefill is what the runner does for a request's first token: vision tower per image (patch embed, blocks,
merger), token embeddings with the image rows replaced, the language model over the paged KV cache through the
SDPA backend, and the lm_head on the one sampled row. ``--chunk-tokens server`` (default) splits the language
model's pass as `firsttoken serve` does by default: whole below --long-prompt-threshold (1,024 tokens), else
long-lane steps of 512 tokens whose later chunks read earlier keys/values from the cache; 0 = one pass.

Parts are timed during real prefills with forward hooks (PyTorch's public API) on the model's modules and an
attention backend wrapper passed to ``load_model`` (its designed seam); nothing in firsttoken changes. A part's
seconds are wall time inside its modules, so "other" parts hold what sits between the matmuls (norms, rotary,
activations, residual adds, reshapes). The prefill total comes from runs without hooks, alternating with the
hooked ones. Every time is the best of --repeats runs (load from other processes only adds time).

FLOPs count a multiply-add as 2 and only useful work: causal attention counts the keys each query may see;
norms, rotary and activations count 0 (they are "other": memory-bound work with no matmul peak to compare).
Peak: the best GFLOP/s that a 2048x2048x2048 matmul (measured between the prefill runs) or one of the model's own
GEMM shapes reached at --threads, in --dtype; load from other processes only lowers a rate, so the best is the
estimate. A part timed inside the model in a quieter moment can still exceed it on a shared machine. bf16 is measured only where the CPU computes it natively
(avx512_bf16 / amx_bf16); elsewhere torch emulates it slower than fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from firsttoken.attention.base import AttentionBackend, AttentionMetadata
from firsttoken.attention.registry import get_backend
from firsttoken.config import ModelConfig, SchedulerConfig
from firsttoken.engine.engine import cpu_has_native_bf16
from firsttoken.inputs.budget import REFERENCE_MAX_TOKENS, plan_image
from firsttoken.inputs.image import ProcessedImage, preprocess_image
from firsttoken.models.loader import load_model
from firsttoken.models.mrope import compute_mrope_positions
from firsttoken.runner.kv_cache import allocate_kv_caches
from firsttoken.tools.bench.images import synth_image

BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PEAK_SIDE = 2048
# (part, what its seconds cover); FLOPs of the "other" parts are 0 by definition
PARTS = (
    ("patch_embed", "Linear over flattened 14x14x2x3 patches"),
    ("vision_linear", "vision blocks' qkv, proj, fc1, fc2"),
    ("vision_attention", "vision SDPA per image + rotary + reshapes (attn minus qkv/proj)"),
    ("vision_other", "vision LayerNorms, GELU, residual adds"),
    ("merger", "LayerNorm + 2x2 merge MLP"),
    ("inputs", "token embeddings, image rows merged, M-RoPE positions, attention metadata"),
    ("lm_linear", "LM qkv_proj, o_proj, gate_up_proj, down_proj"),
    ("lm_attention", "LM KV-cache write + causal SDPA (the attention backend)"),
    ("lm_other", "LM RMSNorms, rotary, SiLU*up, residual adds"),
    ("lm_head", "lm_head on the sampled row"),
)
LINEAR_PARTS = ("patch_embed", "vision_linear", "merger", "lm_linear", "lm_head")


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
    for i, (w, h) in enumerate(sizes):
        plan = plan_image(w, h, image_max_tokens, 4, config.vision)
        images.append(preprocess_image(synth_image(w, h, f"roofline:{i}"), config.vision, plan.min_pixels,
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
    e, mlp = v.embed_dim, int(v.embed_dim * v.mlp_ratio)
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


def watch_model(model: nn.Module, clock: PartClock) -> None:
    """Hooks per part; groups starting with "_" are enclosing totals that _split turns into parts."""
    vis = model.visual
    clock.watch(vis, "_visual")
    clock.watch(vis.patch_embed, "patch_embed")
    clock.watch(vis.merger, "merger")
    for block in vis.blocks:
        clock.watch(block, "_vision_blocks")
        clock.watch(block.attn, "_vision_attn")
        clock.watch(block.attn.qkv, "_vision_attn_linear")
        clock.watch(block.attn.proj, "_vision_attn_linear")
        clock.watch(block.mlp.fc1, "_vision_mlp_linear")
        clock.watch(block.mlp.fc2, "_vision_mlp_linear")
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            clock.watch(lin, "lm_linear")


def prefill(model: nn.Module, config: ModelConfig, prompt: Prompt, clock: PartClock | None) -> torch.Tensor:
    """One request's prefill to its first-token logits, as the runner does it (encode, embed, LM chunks, head)."""
    span = clock.span if clock else _no_span
    num_blocks = -(-len(prompt.ids) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, model.dtype, "cpu")
    with torch.inference_mode():
        embeds = [model.visual(im.pixel_values, [im.grid_thw]) for im in prompt.images]
        with span("inputs"):
            input_ids = torch.tensor(prompt.ids)
            x = model.embed_tokens(input_ids)
            if embeds:
                x[input_ids == config.image_token_id] = torch.cat(embeds).to(x.dtype)
            positions = compute_mrope_positions(prompt.ids, prompt.grids, config).positions
        table = [list(range(num_blocks))]
        for start, end in prompt.chunks:
            with span("inputs"):
                meta = AttentionMetadata.build([end - start], [start], table, BLOCK_SIZE)
            with span("_lm_forward"):
                hidden = model(x[start:end], positions[:, start:end], kv_caches, meta)
        with span("lm_head"):
            return model.compute_logits(hidden[-1:])


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
    inside them (vision: rotary tables, norms, GELU, residuals; LM: norms, rotary, SiLU, residuals)."""
    parts = {name: s.get(name, 0.0) for name, _ in PARTS}
    attn_linear, mlp_linear = s.get("_vision_attn_linear", 0.0), s.get("_vision_mlp_linear", 0.0)
    parts["vision_linear"] = attn_linear + mlp_linear
    parts["vision_attention"] = max(0.0, s.get("_vision_attn", 0.0) - attn_linear)
    outside_blocks = s.get("_visual", 0.0) - s.get("_vision_blocks", 0.0) - parts["patch_embed"] - parts["merger"]
    inside_blocks = s.get("_vision_blocks", 0.0) - s.get("_vision_attn", 0.0) - mlp_linear
    parts["vision_other"] = max(0.0, outside_blocks + inside_blocks)
    parts["lm_other"] = max(0.0, s.get("_lm_forward", 0.0) - s.get("lm_linear", 0.0) - s.get("lm_attention", 0.0))
    parts["_hooked_wall"] = wall
    return parts


# ---- peak --------------------------------------------------------------------------------------------------------
def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5, min_s: float = 0.2) -> float:
    """Best GFLOP/s of [m, k] rows through a [n, k] weight, as nn.Linear runs it (F.linear, no bias), over
    ``repeats`` timed batches of >= min_s each."""
    x, weight = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    F.linear(x, weight)
    best = 0.0
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_s or calls == 0:
            F.linear(x, weight)
            calls += 1
        best = max(best, 2 * m * k * n * calls / elapsed / 1e9)
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
        e, mlp = v.embed_dim, int(v.embed_dim * v.mlp_ratio)
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


def rows_for(flops: dict[str, float], seconds: dict[str, float], wall_s: float, peak: float) -> list[PartRow]:
    """Per part; its share is of the parts' sum (each part's best comes from its own fastest run)."""
    rows = []
    for name, covers in PARTS:
        s, f = seconds[name], flops[name]
        rate = f / s / 1e9 if f and s else None
        rows.append(PartRow(name, covers, f / 1e9, s, rate, rate / peak if rate else None, s / wall_s))
    return rows


def aggregate(rows: list[PartRow], names: tuple[str, ...] | None, total_s: float, peak: float) -> dict[str, float]:
    picked = [r for r in rows if names is None or r.part in names]
    gflop = sum(r.gflop for r in picked)
    seconds = total_s if names is None else sum(r.seconds for r in picked)
    return {"gflop": gflop, "seconds": seconds, "gflops": gflop / seconds, "pct_of_peak": gflop / seconds / peak}


def print_report(result: dict) -> None:
    m, p = result["machine"], result["prompt"]
    print(f"CPU {m['cpu']}, {m['cores']} cores, flags {' '.join(m['cpu_flags']) or '-'}; threads {result['threads']}; "
          f"load {m['loadavg']}")  # fmt: skip
    print(f"prompt: {p['tokens']} tokens ({p['text_tokens']} text, {p['visual_tokens']} visual from "
          f"{p['images']}), LM passes {p['chunks']}; dtype {result['dtype']}; best of {result['repeats']}")
    peak = result["peak"]
    print(f"matmul peak ({result['dtype']}, best of {PEAK_SIDE}^3 and the model's shapes): {peak['gflops']:.1f} "
          f"GFLOP/s ({PEAK_SIDE}^3: {peak['square_gflops']:.1f})"
          + (f"; bf16 {peak['bf16_gflops']:.1f}" if peak.get("bf16_gflops") else f"; bf16: {peak['bf16_note']}"))
    for name, (shape, rate) in result["shapes"].items():
        print(f"  {name:16s} {'x'.join(map(str, shape)):>16s}  {rate:7.1f} GFLOP/s ({rate / peak['gflops']:.0%})")
    print(f"\n{'part':18s}{'GFLOP':>9s}{'seconds':>9s}{'GFLOP/s':>9s}{'% peak':>8s}{'% time':>8s}  covers")
    for r in result["rows"]:
        rate = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        pct = "-" if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.0%}"
        print(f"{r['part']:18s}{r['gflop']:9.2f}{r['seconds']:9.3f}{rate:>9s}{pct:>8s}{r['share_of_time']:8.0%}  "
              f"{r['covers']}")  # fmt: skip
    for label, key, target in (("LM linear layers", "lm_linear", 0.6), ("whole prefill", "total", 0.4)):
        a = result["aggregates"][key]
        verdict = "met" if a["pct_of_peak"] >= target else "MISS"
        print(f"{label:18s}{a['gflop']:9.2f}{a['seconds']:9.3f}{a['gflops']:9.1f}{a['pct_of_peak']:8.0%}"
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
    config = ModelConfig.from_pretrained(model_dir)
    backend = TimedBackend(get_backend("sdpa"))
    model = load_model(model_dir, dtype, attn_backend=backend)
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
    if cpu_has_native_bf16():
        peak["bf16_gflops"] = matmul_gflops(*cube, torch.bfloat16)
    else:
        peak["bf16_note"] = "not native on this CPU (no avx512_bf16/amx_bf16): not measured"
    rows = rows_for(flops, seconds, sum(seconds[name] for name, _ in PARTS), peak["gflops"])
    # hooks add no measurable time (the parts add up to the hooked wall), so the fastest run of either kind counts
    whole_s = min(total_s, seconds["_hooked_wall"])
    visual = sum(im.num_tokens for im in prompt.images)
    return {
        "machine": machine_info(), "threads": args.threads, "dtype": args.dtype, "repeats": args.repeats,
        "model": str(model_dir),
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
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
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
