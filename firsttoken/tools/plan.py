"""KV capacity planning from a checkpoint's shapes: where a device's memory goes, how much KV one
request holds, how many fit, which flags.

The arithmetic here is deliberately its own (it imports no engine, scheduler or kv code) so that the
oracle test can hold it against the real scheduler. It mirrors the scheduler's admission rule,
stated here as the contract this module plans for:

    a waiting request is admitted when the pool has ceil(min(prompt + decode_reserve, max_model_len) / block)
    free blocks (whole-prompt admission, prefix cache off), and grows one block per block_size decoded tokens.

So "fits" means: blocks for prompt + reserve, where prompt = text + images x image tokens + videos x
video tokens + template overhead. A video's tokens are at most its budget (--video-max-tokens), and
at most what a clip of ``video_seconds`` can cost at serve's sampling (video_fps, at least 4 frames,
video_max_frames; each two-frame grid at most video_max_frame_tokens): an upper bound, since a small
frame costs less.
num_kv_blocks = kv_cache_memory_bytes // (kv_bytes_per_token x block_size), as the engine sizes its
pool.

The pool is either given (``kv_cache_memory_bytes``, what ``serve --kv-cache-memory`` takes) or what
a device's memory leaves, as vLLM's --gpu-memory-utilization reads it:

    KV pool = memory x utilization - weights - workspace - encoder cache     (rounded down to a MiB)
    weights = parameters (LM + vision tower + lm_head unless tied) x dtype bytes; with --quantization fp16 or bf16 the
              language model's linear layers (and the lm_head, a 2-byte copy when tied) count 2 bytes each
    workspace = max(LM step, vision tower): the tower runs before the step's forward, not beside it
      LM step = activations (T tokens x (2 hidden + 2 q + 2 kv + 3 intermediate) x B)
              + attention scores of one chunk (2 x heads x T x max_model_len x B, the CPU SDPA path)
              + logits and probabilities of the sampled rows (2 x rows x vocab x 4 B)
      vision tower = one vision item at the budget (an image, or a video's two-frame grid: the tower attends within
                     one): patches x (6 width + 2 mlp width (3 if gated)) x B
    T = --max-batched-tokens, rows = min(peak, T), patches = the item's tokens x spatial_merge_size^2.

The subtraction and the rounding are firsttoken/device_memory.py's ``kv_pool_from_device``, the
function the engine's resolve step calls on CUDA with --gpu-memory-utilization (the same default,
0.9), so plan and engine agree by construction: plan passes its weights for the engine's bytes in
use after loading and its workspace for the engine's profiling peak; on a real device those two are
measured (after the load, around one profiling forward at the budgets' largest step) and replace the
estimates.

Each term is an estimate of buffers, not a measurement; the utilization margin (default 10%) is what
covers the allocator's fragmentation, the framework's own memory and what the estimate misses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from firsttoken.config import (
    FLOAT32_ACTIVATIONS,
    QUANTIZATIONS,
    CacheConfig,
    SchedulerConfig,
    VideoConfig,
)
from firsttoken.device_memory import (
    GPU_MEMORY_UTILIZATION,
    DeviceMemoryTooSmall,
    kv_pool_from_device,
)
from firsttoken.inputs.budget import image_tokens_at_most
from firsttoken.models.registry import served_image_processor
from firsttoken.tools.model_shape import (  # noqa: F401  (re-exported: doctor and the benchmarks read them here)
    DTYPE_BYTES,
    ConfigFieldMissing,
    ModelShape,
    load_config,
    safetensors_weight_bytes,
)
from firsttoken.units import format_bytes, format_size, parse_bytes  # noqa: F401  (parse_bytes re-exported)

# Qwen2-VL's chat template around one user turn with the default system prompt:
# "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" ... "<|im_end|>\n
# <|im_start|>assistant\n" is ~21 tokens with Qwen's tokenizer; each image or video adds
# <|vision_start|>, <|vision_end|> (Qwen3-VL's per-grid timestamps in a video are not counted).
TEMPLATE_BASE_TOKENS = 21
TEMPLATE_TOKENS_PER_IMAGE = 2
# share of the device's memory the server may use: serve's default
MEMORY_UTILIZATION = GPU_MEMORY_UTILIZATION
MIB = 2**20
# serve's
_CACHE_DEFAULTS, _SCHEDULER_DEFAULTS, _VIDEO_DEFAULTS = (
    CacheConfig(),
    SchedulerConfig(),
    VideoConfig(),
)


class DoesNotFit(ValueError):
    """The device cannot hold the weights and the workspace with room left for one KV block."""


class UnderOneTile(ValueError):
    """A tiling family's image budget under one tile (serve refuses it)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def video_tokens_at_most(seconds: float, video: VideoConfig = _VIDEO_DEFAULTS) -> int:
    """Visual tokens a clip of ``seconds`` costs at most under ``video``: its sampled frames
    (video_fps, at least 4, at most video_max_frames, an even count) in two-frame grids of at most
    video_max_frame_tokens each, within video_max_tokens. The frame size decides the rest; only an
    upper bound is known without the clip."""
    frames = min(max(4, round(seconds * video.video_fps)), video.video_max_frames)
    frames -= frames % 2
    return min(video.video_max_tokens, frames // 2 * video.video_max_frame_tokens)


@dataclass(frozen=True)
class PlanInputs:
    peak_concurrency: int
    # Exactly one of the two: the KV pool itself (serve --kv-cache-memory), or the device's whole
    # memory, of which the pool gets what memory_utilization leaves after weights, workspace and the
    # encoder cache.
    kv_cache_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    memory_utilization: float = MEMORY_UTILIZATION
    text_tokens: int = 800
    images_per_request: int = 3
    image_tokens: int = 1200  # per-image visual-token budget (--image-max-tokens)
    videos_per_request: int = 0
    video_tokens: int = _VIDEO_DEFAULTS.video_max_tokens  # per video (at most --video-max-tokens)
    output_tokens: int = 256
    dtype: str = "bfloat16"
    # serve --quantization; fp16, int8 and bf16 run float32 activations; auto = none
    quantization: str = "none"
    block_size: int = _CACHE_DEFAULTS.block_size
    decode_reserve_tokens: int = _SCHEDULER_DEFAULTS.decode_reserve_tokens
    template_overhead_tokens: int | None = None  # None: TEMPLATE_BASE_TOKENS + 2 per image or video
    max_model_len: int | None = None  # None: prompt + output rounded up to a block
    # None: serve's default, raised to fit one image + a decode per request
    max_batched_tokens: int | None = None
    encoder_cache_memory_bytes: int = _CACHE_DEFAULTS.encoder_cache_memory_bytes
    # the most visual tokens one image can take under image_tokens on the family's ladder (a tiling
    # family's largest rung at or under it: make_plan sets it); None: image_tokens itself
    image_tokens_at_most: int | None = None
    tokens_per_tile: int | None = None  # a tiling family's; None: native resolution

    @property
    def image_item_tokens(self) -> int:
        """What one image is planned at: its worst case under the budget."""
        return self.image_tokens if self.image_tokens_at_most is None else self.image_tokens_at_most

    @property
    def image_tiles(self) -> int | None:
        """Tiles (crops and the thumbnail) one image takes at most; None: native resolution."""
        return None if self.tokens_per_tile is None else self.image_item_tokens // self.tokens_per_tile

    def __post_init__(self) -> None:
        if (self.kv_cache_memory_bytes is None) == (self.device_memory_bytes is None):
            raise ValueError(
                "give kv_cache_memory_bytes (the KV pool) or device_memory_bytes (the device), "
                "exactly one"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
        if self.quantization in FLOAT32_ACTIVATIONS and self.dtype != "float32":
            raise ValueError(f"quantization {self.quantization} runs float32 activations: plan with --dtype float32")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise ValueError("memory must be positive")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(
                "memory_utilization must be > 0 and <= 1 (a share of the device's memory)"
            )
        if self.peak_concurrency < 1:
            raise ValueError("peak_concurrency must be >= 1")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        for name in (
            "text_tokens",
            "images_per_request",
            "image_tokens",
            "videos_per_request",
            "video_tokens",
            "output_tokens",
            "decode_reserve_tokens",
            "encoder_cache_memory_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.removesuffix('_bytes')} must be >= 0")

    @property
    def prompt_tokens(self) -> int:
        overhead = self.template_overhead_tokens
        if overhead is None:
            overhead = TEMPLATE_BASE_TOKENS + TEMPLATE_TOKENS_PER_IMAGE * (self.images_per_request
                                                                          + self.videos_per_request)
        return (self.text_tokens + self.images_per_request * self.image_item_tokens
                + self.videos_per_request * self.video_tokens + overhead)

    @property
    def vision_item_tokens(self) -> int:
        """The largest vision item the tower runs at once: an image at its budget, or one two-frame
        grid of a video (at most video_max_frame_tokens); 0 without either."""
        image = self.image_item_tokens if self.images_per_request else 0
        grid = (
            min(self.video_tokens, _VIDEO_DEFAULTS.video_max_frame_tokens)
            if self.videos_per_request
            else 0
        )
        return max(image, grid)

    @property
    def batched_tokens(self) -> int:
        """Tokens one step runs: as given, else serve's default raised to one whole image beside
        every running decode, in multiples of 256."""
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        room = (
            _ceil_div(max(self.image_item_tokens, self.vision_item_tokens) + self.peak_concurrency,
                      256)
            * 256
        )
        return max(_SCHEDULER_DEFAULTS.max_batched_tokens, room)


@dataclass(frozen=True)
class Workspace:
    """One engine step's transient buffers at the plan's budgets, bytes (formulas: the module
    docstring)."""

    num_batched_tokens: int  # T
    num_sampled_rows: int  # min(peak, T)
    num_image_patches: int  # one vision item at the budget (an image, or a video's two-frame grid)
    lm_activation_bytes: int
    lm_attention_scores_bytes: int
    logits_bytes: int
    vision_activation_bytes: int

    @property
    def lm_step_bytes(self) -> int:
        return self.lm_activation_bytes + self.lm_attention_scores_bytes + self.logits_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.lm_step_bytes, self.vision_activation_bytes)

    @classmethod
    def estimate(cls, shape: ModelShape, inputs: PlanInputs, max_model_len: int) -> "Workspace":
        b, t = DTYPE_BYTES[inputs.dtype], inputs.batched_tokens
        rows = min(inputs.peak_concurrency, t)
        return cls(
            num_batched_tokens=t,
            num_sampled_rows=rows,
            num_image_patches=shape.vision_patches(inputs.vision_item_tokens)
            if inputs.vision_item_tokens
            else 0,
            lm_activation_bytes=shape.lm_activation_bytes(t, b),
            lm_attention_scores_bytes=shape.lm_attention_scores_bytes(t, max_model_len, b),
            logits_bytes=shape.logits_bytes(rows),
            vision_activation_bytes=(
                shape.vision_activation_bytes(inputs.vision_item_tokens, b)
                if inputs.vision_item_tokens
                else 0
            ),
        )


@dataclass(frozen=True)
class MemoryBudget:
    """Where the memory goes. device_memory_bytes is None when the pool was given rather than
    derived."""

    device_memory_bytes: int | None
    memory_utilization: float
    usable_bytes: int | None  # device x utilization
    weights_bytes: int
    workspace_bytes: int  # Workspace.peak_bytes
    encoder_cache_bytes: int
    kv_cache_memory_bytes: int  # the pool: given, or what usable leaves (whole MiB)

    @property
    def used_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.workspace_bytes
            + self.encoder_cache_bytes
            + self.kv_cache_memory_bytes
        )

    @property
    def device_memory_needed_bytes(self) -> int:
        """The device this plan needs at its utilization: used / utilization."""
        return _ceil_div(self.used_bytes * 10**6, round(self.memory_utilization * 10**6))


def _weights_bytes(shape: ModelShape, inputs: PlanInputs, lm: int, vision: int) -> int:
    """Parameters x dtype bytes; with fp16 or bf16 quantization the language model's linear layers
    at 2 bytes, plus a 2-byte lm_head beside tied embeddings (loading/quant.py); its norms and
    biases (float32 there, a few thousand parameters) are counted at 2 bytes too. With int8 the
    vision tower's parameters are counted at 1 byte as well, and the language model's at 1 (float32
    embeddings kept for lookups; an int8 lm_head beside tied ones); norms, biases, the patch
    embedding and the per-row scales (4 bytes per output row, under 1% of a layer) are not told
    apart."""
    dtype_bytes = DTYPE_BYTES[inputs.dtype]
    # auto: counted as none (an upper bound: see UNQUANTIZED)
    if inputs.quantization in UNQUANTIZED:
        return (lm + vision) * dtype_bytes
    embed = shape.vocab_size * shape.hidden_size
    tied_head = embed if shape.tie_word_embeddings else 0
    if inputs.quantization == "int8":
        return embed * dtype_bytes + (lm - embed + tied_head) + vision
    return (vision + embed) * dtype_bytes + (lm - embed + tied_head) * 2


_PACKED = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8"}
# serve's --quantization auto picks bf16 weights only for a checkpoint stored in bf16 on a CPU that
# runs float32 activations, which a plan cannot know: it counts auto as none, the larger of the two
UNQUANTIZED = ("none", "auto")


def _memory_budget(
    inputs: PlanInputs, weights: int, num_params: int, workspace: int, block_bytes: int
) -> MemoryBudget:
    """The KV pool: given, or the device's usable memory minus the rest; DoesNotFit when that is
    under a block."""
    encoder, util = inputs.encoder_cache_memory_bytes, inputs.memory_utilization
    if inputs.kv_cache_memory_bytes is not None:
        return MemoryBudget(
            None, util, None, weights, workspace, encoder, inputs.kv_cache_memory_bytes
        )
    device = inputs.device_memory_bytes
    assert device is not None  # PlanInputs holds exactly one of the two
    usable = int(device * util)
    usable_text = f"{format_bytes(device)} x {util:g} utilization = {format_bytes(usable)} usable"
    # fp16, bf16 and int8 load the float32 weights first: when they fit, the packed ones do too (the
    # check below is for the rest)
    if inputs.quantization not in UNQUANTIZED and num_params * DTYPE_BYTES[inputs.dtype] > usable:
        raise DoesNotFit(
            f"loading reads the float32 weights first ({format_bytes(num_params * DTYPE_BYTES[inputs.dtype])}) and "
            f"packs them to {_PACKED[inputs.quantization]} one layer at a time, but "
            f"{usable_text}; plan for a larger device"
        )
    if weights > usable:
        raise DoesNotFit(
            f"the weights alone need {format_bytes(weights)} ({num_params:,} parameters x "
            f"{DTYPE_BYTES[inputs.dtype]} B in {inputs.dtype}) but {usable_text}; plan for a larger device")
    # the engine's own arithmetic (device_memory.py), with the weights for the bytes in use after
    # loading and the workspace estimate for the profiling peak that a real device measures
    try:
        pool = kv_pool_from_device(
            device,
            util,
            weights,
            workspace,
            encoder,
            block_bytes // inputs.block_size,
            inputs.block_size,
        ).pool_bytes
    except DeviceMemoryTooSmall:
        raise DoesNotFit(
            f"weights {format_bytes(weights)} + step workspace {format_bytes(workspace)} + encoder cache "
            f"{format_bytes(encoder)} leave no room for a KV pool in {usable_text}; lower --max-batched-tokens, "
            "--image-tokens or --encoder-cache-memory, or plan for a larger device"
        ) from None
    return MemoryBudget(device, util, usable, weights, workspace, encoder, pool)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    model_type: str
    # weights
    num_params: int  # from config shapes
    num_params_language_model: int
    num_params_vision: int
    # num_params x dtype bytes (fp16 or bf16 quantization: the LM's linear layers x 2; int8: x 1)
    weights_bytes: int
    safetensors_params: int | None  # summed from safetensors headers when the model dir has them
    safetensors_bytes: int | None
    # memory
    workspace: Workspace
    memory: MemoryBudget
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
    # the pool (= memory.kv_cache_memory_bytes): what serve --kv-cache-memory gets
    kv_cache_memory_bytes: int
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


def make_plan(
    config: dict[str, Any], inputs: PlanInputs, model_dir: str | Path | None = None
) -> Plan:
    """The plan; ConfigFieldMissing (a ValueError) names a config.json field it lacks, DoesNotFit
    says which term leaves no KV pool on the device."""
    shape = ModelShape.from_config(config)
    inputs = _on_the_family_ladder(config, inputs, model_dir)
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
    workspace = Workspace.estimate(shape, inputs, max_model_len)
    memory = _memory_budget(
        inputs,
        _weights_bytes(shape, inputs, lm, vision),
        lm + vision,
        workspace.peak_bytes,
        block_bytes,
    )
    num_blocks = memory.kv_cache_memory_bytes // block_bytes

    blocks_each_at_peak = num_blocks // inputs.peak_concurrency
    max_prompt = max(0, blocks_each_at_peak * bs - inputs.decode_reserve_tokens)
    max_conc = num_blocks // admit_blocks if admit_blocks else 0
    return Plan(
        inputs=inputs,
        model_type=shape.model_type,
        num_params=lm + vision,
        num_params_language_model=lm,
        num_params_vision=vision,
        weights_bytes=memory.weights_bytes,
        safetensors_params=st[0] if st else None,
        safetensors_bytes=st[1] if st else None,
        workspace=workspace,
        memory=memory,
        kv_bytes_per_token=kv_tok,
        seed_kv_bytes_per_token=seed_tok,
        seed_overstatement=seed_tok / kv_tok,
        prompt_tokens=prompt,
        max_model_len=max_model_len,
        admission_blocks_per_request=admit_blocks,
        admission_kv_bytes_per_request=admit_blocks * block_bytes,
        full_blocks_per_request=full_blocks,
        full_kv_bytes_per_request=full_blocks * block_bytes,
        kv_cache_memory_bytes=memory.kv_cache_memory_bytes,
        num_kv_blocks=num_blocks,
        pool_bytes_to_admit_peak=inputs.peak_concurrency * admit_blocks * block_bytes,
        pool_bytes_for_peak_without_preemption=inputs.peak_concurrency * full_blocks * block_bytes,
        max_concurrency=max_conc,
        max_concurrency_without_preemption=num_blocks // full_blocks if full_blocks else 0,
        max_prompt_tokens_at_peak=min(max_prompt, shape.max_position_embeddings),
        max_images_at_peak=_images_at_peak(inputs, max_prompt),
        fits=max_conc >= inputs.peak_concurrency,
        serve_flags=_serve_flags(inputs, memory, max_model_len, workspace, max_conc),
    )


def _on_the_family_ladder(config: dict[str, Any], inputs: PlanInputs,
                          model_dir: str | Path | None) -> PlanInputs:
    """A tiling family's image is planned at the worst case its budget buys within the checkpoint's
    own tiling (InternVL: 1,200 tokens buy 3 crops and the thumbnail, 1,024 tokens); a
    native-resolution one at its budget. DoesNotFit for a budget under one tile (serve refuses it)."""
    proc = served_image_processor(config, model_dir)
    if proc is None or proc.tiles is None:  # (a config firsttoken does not serve: planned as Qwen)
        return inputs
    at_most = image_tokens_at_most(inputs.image_tokens, proc)
    if at_most is None:
        raise UnderOneTile(f"under one tile: this model's images cost at least {proc.tokens_per_tile} tokens "
                           "(serve refuses such an --image-max-tokens)")
    return replace(inputs, image_tokens_at_most=at_most, tokens_per_tile=proc.tokens_per_tile)


def _images_at_peak(inputs: PlanInputs, max_prompt: int) -> int:
    """Images that fit beside the text in a prompt of ``max_prompt`` tokens: each costs its budget
    plus its template tokens (an explicit template overhead is taken as fixed; videos included)."""
    per_image_overhead = TEMPLATE_TOKENS_PER_IMAGE if inputs.template_overhead_tokens is None else 0
    per_image = inputs.image_item_tokens + per_image_overhead
    fixed = inputs.prompt_tokens - inputs.images_per_request * per_image
    return max(0, (max_prompt - fixed) // per_image) if per_image else 0


def _serve_flags(inputs: PlanInputs, memory: MemoryBudget, max_model_len: int,
                 workspace: Workspace, max_conc: int) -> dict[str, str]:
    flags = {
        "--kv-cache-memory": format_size(memory.kv_cache_memory_bytes),
        "--max-model-len": str(max_model_len),
        "--image-max-tokens": str(inputs.image_tokens),
        "--max-batched-tokens": str(workspace.num_batched_tokens),
        "--max-num-seqs": str(max(1, min(max_conc, inputs.peak_concurrency))),
        "--encoder-cache-memory": format_size(inputs.encoder_cache_memory_bytes),
        "--block-size": str(inputs.block_size),
        "--decode-reserve-tokens": str(inputs.decode_reserve_tokens),
        "--dtype": inputs.dtype,
    }
    if inputs.videos_per_request:
        flags["--video-max-tokens"] = str(inputs.video_tokens)
    if inputs.quantization not in UNQUANTIZED:
        flags["--quantization"] = inputs.quantization
    return flags


_QUANTIZED_WEIGHTS = {"fp16": "; LM linear layers x 2 B", "bf16": "; LM linear layers x 2 B",
                      "int8": "; LM and vision linear layers x 1 B"}


def _memory_rows(plan: Plan) -> list[tuple[str, str]]:
    """Where the memory goes, one term a row; the pool's row says whether it was given or
    derived."""
    i, m, w = plan.inputs, plan.memory, plan.workspace
    item = (
        "1 image"
        if i.images_per_request and i.image_tokens >= i.vision_item_tokens
        else "1 video grid"
    )
    image = (
        f"{item} of {i.vision_item_tokens} tokens = {w.num_image_patches:,} patches"
        if w.num_image_patches
        else "no images"
    )
    terms = [  # (nested under the workspace, label, value)
        (
            False,
            f"weights ({plan.num_params:,} params x {DTYPE_BYTES[i.dtype]} B"
            f"{_QUANTIZED_WEIGHTS.get(i.quantization, '')})",
            format_bytes(m.weights_bytes),
        ),
        (False, "step workspace = max(LM step, vision tower)", format_bytes(m.workspace_bytes)),
        (
            True,
            f"LM activations ({w.num_batched_tokens} tokens)",
            format_bytes(w.lm_activation_bytes),
        ),
        (
            True,
            f"LM attention scores ({w.num_batched_tokens} x {plan.max_model_len} context)",
            format_bytes(w.lm_attention_scores_bytes),
        ),
        (
            True,
            f"logits + probabilities ({w.num_sampled_rows} rows, fp32)",
            format_bytes(w.logits_bytes),
        ),
        (True, f"vision tower ({image})", format_bytes(w.vision_activation_bytes)),
        (False, "encoder cache (--encoder-cache-memory)", format_bytes(m.encoder_cache_bytes)),
    ]
    pool = f"{format_bytes(m.kv_cache_memory_bytes)} = {plan.num_kv_blocks:,} blocks"
    if m.device_memory_bytes is None:
        return [*((("  " if nested else "") + k, v) for nested, k, v in terms),
                ("KV pool (given: --kv-cache-memory)", pool),
                (f"device memory this needs (at {m.memory_utilization:g} utilization)",
                 format_bytes(m.device_memory_needed_bytes))]
    return [
        (
            "device memory",
            f"{format_bytes(m.device_memory_bytes)} x {m.memory_utilization:g} utilization = "
            f"{format_bytes(m.usable_bytes or 0)} usable",
        ),
        *((("    " if nested else "- ") + k, v) for nested, k, v in terms),
        ("= KV pool (what is left, whole MiB)", pool),
    ]


def format_plan(plan: Plan) -> str:
    i = plan.inputs
    video = i.videos_per_request * i.video_tokens
    rows: list[tuple[str, str]] = [
        ("model", f"{plan.model_type}, {i.dtype}, block {i.block_size} tokens"),
        ("parameters (from config shapes)",
         f"{plan.num_params:,} = {plan.num_params_language_model:,} LM + {plan.num_params_vision:,} vision"),
    ]
    if plan.safetensors_params is not None:
        rows.append(("safetensors headers", f"{plan.safetensors_params:,} params, "
                     f"{format_bytes(plan.safetensors_bytes or 0)} on disk"))
    rows += _memory_rows(plan)
    rows += [
        ("KV bytes / token (GQA: 2 x L x KV heads x hd x B)", f"{plan.kv_bytes_per_token:,} B"),
        ("seed formula (2 x L x attn heads x hd x B)",
         f"{plan.seed_kv_bytes_per_token:,} B  ({plan.seed_overstatement:.1f}x overstated)"),
        ("prompt tokens / request",
         f"{plan.prompt_tokens:,} = {i.text_tokens} text + {i.images_per_request} x {i.image_item_tokens} image "
         + (f"({i.image_tiles} tiles at most under {i.image_tokens}) " if i.image_tiles else "")
         + (f"+ {i.videos_per_request} x {i.video_tokens} video " if i.videos_per_request else "")
         + f"+ {plan.prompt_tokens - i.text_tokens - i.images_per_request * i.image_item_tokens - video} template"),
        ("KV at admission (prompt + reserve)",
         f"{plan.admission_blocks_per_request} blocks = {format_bytes(plan.admission_kv_bytes_per_request)}"),
        ("KV at last token (prompt + output)",
         f"{plan.full_blocks_per_request} blocks = {format_bytes(plan.full_kv_bytes_per_request)}"),
        (f"pool to admit the peak ({i.peak_concurrency})", format_bytes(plan.pool_bytes_to_admit_peak)),
        ("pool for the peak to finish without preemption",
         format_bytes(plan.pool_bytes_for_peak_without_preemption)),
        ("max concurrency (admitted at once)", f"{plan.max_concurrency}"
         + ("" if plan.fits else f"  < peak {i.peak_concurrency}: DOES NOT FIT")),
        ("max concurrency without preemption", str(plan.max_concurrency_without_preemption)),
        (f"largest prompt at peak {i.peak_concurrency}", f"{plan.max_prompt_tokens_at_peak:,} tokens "
         f"(= {plan.max_images_at_peak} images of {i.image_item_tokens} beside {i.text_tokens} text tokens"
         + (f" and {i.videos_per_request} x {i.video_tokens} video)" if i.videos_per_request else ")")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append("firsttoken serve " + " ".join(f"{k} {v}" for k, v in plan.serve_flags.items()))
    return "\n".join(lines)
