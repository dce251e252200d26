"""One config tree: every option of the server, engine and inputs, with its only default, its range
check and its flag, in one place. ``firsttoken serve``'s flags are generated from it (cli/serve.py:
name, type, help and default read off each field), so a default cannot drift between a flag table
and a dataclass.

    ServeConfig
      model, served_model_name
      engine: EngineConfig       dtype, device, attention backend, threads, seed, timeouts
        cache: CacheConfig       KV pool, block size, prefix and encoder caches
        scheduler: SchedulerConfig   step budget, lanes, admission, queues, context length
        grammar: GrammarConfig   output grammars' work: threads, a step's wait for a mask, a request's budget
      images: ImageConfig        visual-token budget, image and input limits, where images may come from
      videos: VideoConfig        video budget (frames, tokens) and the limits checked on a container's header
      server: ServerConfig       HTTP: bind, bodies, concurrency, shutdown, logs, /stats, API key

Each field's ``option(...)`` metadata gives its help text, and where they differ from the field
name, its flag (``--kv-cache-memory`` for ``kv_cache_memory_bytes``), a parser (sizes as ``1GiB``)
and how its default is shown. A ValueError from a ``__post_init__`` names the field first, so the
CLI can name the flag (``flag_for_field``). The checkpoint's architecture is not configured here:
its model family parses it (models/model_config.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from firsttoken.units import format_size, parse_bytes

# Every choice an option offers is its field's type: the flag's metavar, the range check and the
# error message come from these (``choices_of``, ``check_choice``). ``auto`` is settled in one
# place, loading/load_plan.py (dtype, quantization, kernels), with the rest of what the engine runs with
# in engine/resolve.py.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ResolvedDtype = Literal["float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "fp16", "int8", "bf16"]  # loading/quant.py
ResolvedQuantization = Literal["none", "fp16", "int8", "bf16"]
# kernels/cpu_linear.py; loading/load_plan.py decides what auto takes
CpuKernels = Literal["auto", "on", "off"]
# where the engine runs; engine/resolve.py settles auto (loading/load_plan.py)
Device = Literal["auto", "cpu", "cuda"]
ResolvedDevice = Literal["cpu", "cuda"]
# loading/loader.py: the checkpoint's safetensors, or random weights
LoadFormat = Literal["auto", "dummy"]
AttentionBackendName = Literal["sdpa", "triton"]  # attention/registry.py
# runner/cuda_graphs.py; engine/resolve.py decides what auto takes
CudaGraphs = Literal["auto", "off"]
Scheduling = Literal["lanes", "fcfs"]
LongOrder = Literal["deadline", "least-work"]
KvAdmission = Literal["whole-prompt", "optimistic"]

DTYPES: tuple[str, ...] = get_args(Dtype)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# quantizations whose products take float32 activations
FLOAT32_ACTIVATIONS = ("fp16", "int8", "bf16")
CPU_KERNELS: tuple[str, ...] = get_args(CpuKernels)
DEVICES: tuple[str, ...] = get_args(Device)
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)


def choices_of(annotation: Any) -> tuple[str, ...]:
    """The values a ``Literal`` type (or an alias of one) allows; () for any other type."""
    return tuple(get_args(annotation)) if get_origin(annotation) is Literal else ()


def check_choice(name: str, value: Any, choices: Any, note: str = "") -> None:
    """ValueError naming the field unless ``value`` is one of the ``Literal`` type ``choices``'
    values."""
    allowed = choices_of(choices)
    if value in allowed:
        return
    if len(allowed) == 2:
        raise ValueError(f"{name} must be {allowed[0]!r} or {allowed[1]!r}{note}")
    raise ValueError(f"{name} must be one of {', '.join(allowed)}{note}")


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _check_options(obj: Any) -> None:
    """Every field of a config dataclass as its option declares: a ``Literal``-typed one holds one
    of its values (its metadata may add a ``choice_note`` to the message), a number is within its
    declared range, and a ``typed`` one holds its typed value (set here, from text)."""
    hints = _type_hints(type(obj))
    for f in fields(obj):
        value, m = getattr(obj, f.name), f.metadata
        if choices_of(hints[f.name]):
            check_choice(f.name, value, hints[f.name], m.get("choice_note", ""))
        if m.get("typed") is not None:
            object.__setattr__(obj, f.name, m["typed"](f.name, value))
        bounds = [(op, m.get(op)) for op in ("ge", "gt", "le") if m.get(op) is not None]
        if not bounds or (value is None and f.default is None):
            continue
        if value is None or not all(_RANGE_OPS[op](value, bound) for op, bound in bounds):
            unit = f" {m['unit']}" if m.get("unit") else ""
            unset = f" (or unset: {m['unset']})" if m.get("unset") else ""
            said = " and ".join(f"{_RANGE_WORDS[op]} {bound:g}" for op, bound in bounds)
            raise ValueError(f"{f.name} must be {said}{unit}{unset}")


_RANGE_OPS: dict[str, Callable[[Any, float], bool]] = {
    "ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b}
_RANGE_WORDS = {"ge": ">=", "gt": ">", "le": "<="}


class TimeBound(str):
    """auto, off, or a positive number of seconds (--step-time-target, --itl-target): the flag's
    text, with what it means."""

    @classmethod
    def of(cls, name: str, value: Any) -> TimeBound:
        text = str(value).strip()
        if text not in ("auto", "off"):
            try:
                seconds = float(text)
            except ValueError:
                raise ValueError(f"{name} must be auto, off or a number of seconds") from None
            if not seconds > 0:
                raise ValueError(f"{name} must be > 0 seconds (or auto, or off)")
        return cls(text)

    @property
    def is_auto(self) -> bool:
        return self == "auto"

    @property
    def is_off(self) -> bool:
        return self == "off"

    @property
    def seconds(self) -> float | None:
        """The number given, or None for auto / off."""
        return None if self in ("auto", "off") else float(self)


class Objectives(str):
    """TTFT objectives per class, ``text=1.5,image=12`` (--ttft-slo; empty: none): the flag's text,
    with its seconds per class."""

    @classmethod
    def of(cls, name: str, value: Any) -> Objectives:
        text = str(value)
        try:
            slo = _objectives(text)
        except ValueError:
            raise ValueError(
                f"{name} must look like text=1.5,image=12 (seconds per class)"
            ) from None
        if set(slo) - {"text", "image", "video"} or any(not v > 0 for v in slo.values()):
            raise ValueError(
                f"{name} classes are text, image and video, each with a positive number of seconds"
            )
        return cls(text)

    @property
    def seconds(self) -> dict[str, float]:
        """{"text": seconds, "image": seconds, "video": seconds} for the classes given (a prompt
        with any video is of class video)."""
        return _objectives(self)


def _objectives(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        out[name.strip()] = float(value)
    return out


def option(
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    shown: str | None = None,
    switch_off: bool = False,
    choice_note: str = "",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    unit: str = "",
    unset: str = "",
    typed: Callable[[str, Any], Any] | None = None,
) -> dict[str, Any]:
    """Field metadata: ``switch_off`` makes a bool field a ``--no-...`` flag that sets it False;
    ``choice_note`` follows the list of a ``Literal`` field's values in its error message. The
    range a number must be in: ``ge`` (>=), ``gt`` (>), ``le`` (<=), checked for every field by one
    loop (``_check_options``), its message naming the field, the bounds, ``unit`` and, for a field
    that may be None, what ``unset`` means. ``typed(name, value)``: the field's typed value from its
    flag's text (or the value itself), raising a ValueError that names the field."""
    return {"help": help, "flag": flag, "parse": parse, "shown": shown, "switch_off": switch_off,
            "choice_note": choice_note, "ge": ge, "gt": gt, "le": le, "unit": unit, "unset": unset,
            "typed": typed}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# ------------------------------------------------------------------------------------------- engine


DEFAULT_KV_CACHE_MEMORY = 2**30  # the KV pool where --kv-cache-memory is not given, on the CPU


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=option("tokens per KV block (a power of two)"))
    # None: not given. On the CPU that is DEFAULT_KV_CACHE_MEMORY (1GiB); on CUDA the pool is what
    # --gpu-memory-utilization of the device leaves (engine/resolve.py, device_memory.py)
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=option(
            "bytes for the paged KV cache pool (e.g. 1GiB); default: 1GiB on the CPU, on cuda what "
            "--gpu-memory-utilization of the device leaves",
            flag="--kv-cache-memory",
            parse=parse_bytes,
            gt=0, unset="the default pool",
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=option(
            "share of the CUDA device's memory the engine may use: the KV pool is what it leaves after the weights, "
            "one profiling step at the largest batch and image the budgets allow, and the encoder cache (as "
            "firsttoken plan --memory computes it); used on cuda when --kv-cache-memory is not given, ignored on "
            "the CPU", gt=0, le=1))
    enable_prefix_caching: bool = field(
        default=True, metadata=option("disable KV prefix caching (for side-by-side measurement)",
                                      flag="--no-prefix-cache", switch_off=True))
    encoder_cache_memory_bytes: int = field(
        default=512 * 2**20, metadata=option("bytes of vision-encoder outputs kept by image hash",
                                             flag="--encoder-cache-memory",
                                             parse=parse_bytes, ge=0))
    enable_encoder_cache: bool = field(
        default=True,
        metadata=option(
            "disable the vision-encoder output cache", flag="--no-encoder-cache", switch_off=True
        ),
    )

    def __post_init__(self) -> None:
        _check_options(self)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")

    @property
    def kv_pool_bytes(self) -> int:
        """The KV pool's bytes where they are not taken from a device: as given, else
        DEFAULT_KV_CACHE_MEMORY."""
        return (
            DEFAULT_KV_CACHE_MEMORY
            if self.kv_cache_memory_bytes is None
            else self.kv_cache_memory_bytes
        )


@dataclass(frozen=True)
class GrammarConfig:
    """How constrained requests' grammar work runs (firsttoken/structured/masks.py): off the step's
    thread, each row's mask bounded per step and per request, so no grammar holds its batch-mates
    back."""

    mask_threads: int = field(default=4, metadata=option(
        "threads that advance constrained requests' grammars by their sampled tokens and fill their next output "
        "masks, several requests at once (the grammar library works without the GIL), off the step's thread",
        flag="--grammar-threads", ge=1))
    mask_wait_s: float = field(default=0.01, metadata=option(
        "seconds a step waits, once its forward is done, for a constrained request's next output mask (worked on "
        "since its last token); only the first step to ask for a mask waits for it: a request whose mask is not "
        "ready samples nothing in this step and its last token runs again in the next steps, which do not wait, so "
        "its batch-mates wait at most this once per token of it (0: never wait)",
        flag="--grammar-mask-wait", ge=0, unit="seconds"))
    request_mask_s: float = field(default=10.0, metadata=option(
        "CPU seconds of grammar work (advancing the matcher, filling masks: each job's own thread time) one "
        "request may use in all; over it, or waiting more than twice as long in wall time for one token's mask "
        "(its work queued behind other requests' or not ending), the request ends with finish_reason error, HTTP "
        "400 (an error event mid-stream) saying so, and its batch-mates go on (an ambiguous grammar's work grows "
        "with each token)", flag="--grammar-mask-budget", gt=0))

    def __post_init__(self) -> None:
        _check_options(self)

    @property
    def pending_mask_s(self) -> float:
        """Wall seconds one token's mask may keep its request pending (from the first step that
        asked for it): twice ``request_mask_s``, so a grammar within its CPU budget has as long
        again to wait for a grammar thread (other requests' jobs ahead of it) or a core, while a job
        that never ends (its CPU is counted only when it does) or one queued behind such jobs still
        ends its request in bounded time."""
        return 2 * self.request_mask_s


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = field(default=2048, metadata=option(
        "tokens (prefill chunks + decodes) one engine step may run", ge=1))
    max_num_seqs: int = field(default=64, metadata=option("sequences one engine step may run",
    ge=1))
    decode_reserve_tokens: int = field(default=64, metadata=option(
        "KV tokens reserved beyond the prompt when a request is admitted", ge=0))
    max_model_len: int | None = field(default=None, metadata=option(
        "context length; default: the checkpoint's, capped by the KV pool", ge=1))
    scheduling: Scheduling = field(default="lanes", metadata=option(
        "lanes (short/long queues, long work capped per step) or fcfs (one FIFO queue, whole-prompt prefills: the "
        "seed's starting point, for comparison)"))
    long_prompt_threshold: int = field(default=1024, metadata=option(
        "prompt tokens (text + image) from which a request takes the long lane", ge=1))
    step_time_target: TimeBound = field(default="auto", metadata=option(
        "seconds one engine step may take, predicted by the step-cost model fitted online from the engine's own "
        "step timings; the long lane fills each step up to it (work-conserving), so a short request arriving "
        "mid-step waits at most one such step. auto: the predicted time of one typical short prompt's prefill, "
        "and while the long lane alone has prompts to prefill (no short prompt waits; decodes ride along unless "
        "--itl-target paces them) throughput-sized steps instead: images encoded whole, chunks of about one short "
        "prompt's size; off: token budgets only (--long-step-tokens, steps yielded to short prefills)",
        typed=TimeBound.of))
    itl_target: TimeBound = field(default="off", metadata=option(
        "with a step-time bound: seconds per token each streaming answer should average, counted from its first "
        "decode step. A step that carries decodes is bounded so that each one's next token is on time by that pace "
        "(an answer that got tokens faster, in decode-only steps, lets steps run up to --step-time-target again; "
        "one behind gets steps of at least 4 per-step constants until it catches up); a short request's own prefill "
        "is still granted whole. Costs image prompts throughput (more steps, each with its fixed cost: "
        "docs/scheduling.md). auto: 0.2 s (5 tokens/s), at least 4x the per-step constant the step-cost model "
        "measured; off: decodes take whole --step-time-target steps, and throughput steps",
        typed=TimeBound.of))
    encoder_interrupt: bool = field(default=True, metadata=option(
        "do not stop the long lane's vision-tower work for a short request (by default a short request that arrives "
        "while a step runs image encoder units stops that step at the next unit; its prefill runs next step and the "
        "image resumes after it); for side-by-side measurement", flag="--no-encoder-interrupt", switch_off=True))
    long_chunk_share: float = field(default=1.0, metadata=option(
        "with a step-time bound: the share of it the long lane's prefill chunks may take in one step (the rest goes "
        "to its vision-tower units, which a short arrival cuts at the next unit); below 1 a short request waits "
        "less behind a long prompt's prefill, and long prompts prefill in more, smaller chunks",
        gt=0, le=1))
    long_step_tokens: int = field(default=512, metadata=option(
        "with --step-time-target off: long-lane work per step in tokens (prefill tokens + encoder units' "
        "token-equivalent cost; a full vision block of an image costs its visual tokens)", ge=1))
    long_step_tokens_idle: int | None = field(default=None, metadata=option(
        "with --step-time-target off: long-lane work per step when no short request is waiting or prefilling "
        "(default: --long-step-tokens)", ge=1))
    long_max_wait_steps: int = field(default=4, metadata=option(
        "steps in a row the long lane may get no work because short work took the step; then it runs anyway "
        "(aging)", ge=0))
    long_order: LongOrder = field(default="deadline", metadata=option(
        "the order of the long lane's work (time-bounded steps). deadline: each request gets a place in line when "
        "it arrives, its arrival time plus --long-slack times its own predicted work; earliest place first, so a "
        "later request overtakes it only if that one is enough smaller to make up the difference (no "
        "starvation). least-work: least predicted remaining work first, with --long-max-passes"))
    long_slack: float = field(default=1.0, metadata=option(
        "with --long-order deadline: seconds of place in line per second of the request's own predicted work "
        "(0: first come, first served within the lane; larger: smaller requests overtake more)",
        ge=0))
    long_max_passes: int = field(default=8, metadata=option(
        "with --long-order least-work: a request passed over this many steps in a row goes first (no starvation)",
        ge=0))
    kv_admission: KvAdmission = field(default="whole-prompt", metadata=option(
        "whole-prompt (start a prefill only when its whole prompt + reserve fits) or optimistic (admit when the "
        "next chunk fits; preempt by recompute when dry)"))
    max_queued_requests: int = field(default=256, metadata=option(
        "requests waiting per lane; beyond it HTTP 429 with Retry-After", ge=1))
    ttft_bias_step: float = field(default=0.05, metadata=option(
        "the predicted TTFT learns its own error per class (0, 1, 2+ images, video) from every first token: each moves "
        "its class's correction factor up or down by this much in log space, towards the median of measured / "
        "predicted (0: no correction)", ge=0, le=1))
    ttft_slo: Objectives = field(default="", metadata=option(
        "time-to-first-token objectives per class, e.g. text=1.5,image=12 (seconds). A new request whose predicted "
        "TTFT exceeds its class's objective first gets a smaller visual-token budget (down to "
        "--image-min-tokens-under-load), then, if that is not enough, HTTP 429 with Retry-After, before any image "
        "is decoded (default: off)", shown="off", typed=Objectives.of))
    ttft_slo_wait_margin: float = field(default=2.0, metadata=option(
        "with --ttft-slo: an image request's budget is lowered until its predicted TTFT plus this many times its "
        "predicted wait (the part beyond its own work, where the predictions' error lies) fits the objective; "
        "refused only when the prediction itself is over it at the lowest budget (0: lower only while over)",
        ge=0))

    def __post_init__(self) -> None:
        _check_options(self)  # ranges; scheduling, kv_admission, long_order; the typed targets

    @property
    def ttft_slo_s(self) -> dict[str, float]:
        """{"text": seconds, "image": seconds, "video": seconds} for the classes given (a prompt
        with any video is of class video)."""
        return self.ttft_slo.seconds

    @property
    def step_time_target_s(self) -> float | None:
        """The fixed target in seconds, or None for auto / off."""
        return self.step_time_target.seconds


@dataclass(frozen=True)
class EngineConfig:
    dtype: Dtype = field(default="auto", metadata=option(
        "auto (bf16 where the CPU computes bf16 in hardware, else float32), float32 (exact vs transformers), "
        "bfloat16, float16"))
    quantization: Quantization = field(default="auto", metadata=option(
        "auto: bf16 (below) where the checkpoint stores the language model's linear weights in bf16 and the engine "
        "runs float32 activations (--dtype auto on a CPU without native bf16, or --dtype float32) with firsttoken's "
        "kernels: the checkpoint's own weights at their own bytes; else none. none: weights in --dtype; "
        "fp16: the language model's linear layers keep float16 weights (half the bytes a decode step "
        "reads), multiplied in float32 by FBGEMM's AVX2 kernel; activations float32 (--dtype auto picks it). "
        "Faster decode on CPUs; not exact against transformers (~2e-4 relative error per product; top-1 "
        "agreement in docs/performance.md); or int8: every linear layer of the language model and the vision "
        "tower keeps int8 weights (one scale per output row), each input row is quantized with its own scale and "
        "multiplied exactly in int32 (torch._int_mm for prefill, firsttoken's kernels for decode steps): faster "
        "prefill and decode on CPUs, a quarter of float32's weight bytes; activations float32 (--dtype auto picks "
        "it); not exact (top-1 agreement in docs/performance.md); or bf16: the language model's linear layers keep "
        "bfloat16 weights (half the bytes a decode step reads, widened exactly to float32 by firsttoken's kernels; "
        "prefill widens each weight for torch's float32 product), activations, norms and the KV cache float32 "
        "(--dtype auto picks it): for a checkpoint published in bf16 the same weights and arithmetic as float32, "
        "on any AVX2 CPU"))
    cpu_kernels: CpuKernels = field(default="auto", metadata=option(
        "auto: decode steps' products of at most 16 rows run firsttoken's AVX2 kernels (float32 language model on "
        "an AVX2 + FMA CPU, except Intel's AVX-512 ones, where MKL won; built once with the machine's C compiler, $CC "
        "or cc; where they cannot be built, torch's product, and the log says why); on: the kernels on every CPU. A "
        "bfloat16 language model's products take a bf16 kernel under auto on CPUs with AVX512-BF16 and no AMX "
        "(where it beats torch's), under on anywhere: at most 16 rows with the CPU's AVX512-BF16 dot products, else 4. "
        "Where the kernels are taken, a pure-decode step's decoder layers run as one C call (16 rows at most; "
        "bfloat16 without AVX512-BF16 8; with --quantization bf16 or int8 too); the sampler's argmax and top-k "
        "(k <= 256) take a one-pass kernel (the "
        "same tokens). off: torch's ops (MKL) always. "
        "Prefill is MKL's either way. With --quantization int8, auto and on "
        "take firsttoken's int8 kernels on any CPU (AVX-512 VNNI or AVX2), off computes the same numbers with "
        "torch's ops alone"))
    device: Device = field(default="auto", metadata=option(
        "where the model runs: auto (cuda where torch sees a CUDA device, else cpu), cpu or cuda (CUDA device 0; "
        "--dtype auto is bfloat16 there, and --quantization none: fp16, int8 and bf16 weights are CPU methods)"))
    load_format: LoadFormat = field(default="auto", metadata=option(
        "auto: the checkpoint's safetensors weights; dummy: random weights of the shapes config.json gives (no "
        "weight files needed; tokenizer and processor files still are): to serve and measure a published model's "
        "shape where its weights cannot be downloaded. Answers are nonsense"))
    attention_backend: AttentionBackendName = field(default="sdpa", metadata=option(
        "attention implementation over the paged KV cache: sdpa (torch's SDPA, any device: the reference) or triton "
        "(firsttoken's Triton kernels: paged prefill and split-K decode; --device cuda only, not yet measured on a "
        "GPU: docs/gpu.md)"))
    cuda_graphs: CudaGraphs = field(default="auto", metadata=option(
        "decode steps through CUDA graphs captured at start-up, one per batch-size bucket (1, 2, 4, then every 8 up "
        "to --max-num-seqs; a batch is padded up to its bucket, larger batches and steps with prefill run eagerly). "
        "auto: on with --device cuda and --attention-backend triton (the sdpa backend's decode changes shape with "
        "the longest context, which a graph cannot replay), off on the CPU; off: every step eager"))
    num_threads: int | None = field(default=None, metadata=option(
        "torch threads for the engine (default: all cores)", ge=1))
    decode_threads: int | None = field(default=None, metadata=option(
        "torch threads for steps that only decode (default: one fewer than --num-threads, at least 1: a "
        "decode step is bound by memory bandwidth, and the server's own threads stream its tokens meanwhile); "
        "decode steps that firsttoken's fused decode layers take give torch one thread and those kernels all "
        "--num-threads as workers of their own, which a pre-empted one never stalls", ge=1))
    seed: int | None = field(
        default=None, metadata=option("seed for requests that bring no seed of their own")
    )
    request_timeout_s: float | None = field(default=None, metadata=option(
        "seconds a request may take from arrival to its last token; later it fails with HTTP 504 (or an error "
        "event mid-stream) and its KV blocks are freed (default: no limit)",
        flag="--request-timeout", gt=0, unset="no limit"))
    max_unread_outputs: int = field(default=256, metadata=option(
        "outputs (about one per token) a streaming request may leave unread once the connection's buffers are "
        "full; beyond it the client is not reading: the request is aborted, logged and counted "
        "(firsttoken_requests_aborted_total{reason=\"client_not_reading\"})", ge=1))
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)

    def __post_init__(self) -> None:
        # ranges; dtype, quantization, cpu_kernels, device, load_format, attention_backend
        _check_options(self)
        if self.device == "cuda" and self.quantization in FLOAT32_ACTIVATIONS:
            raise ValueError(f"quantization {self.quantization} runs on the CPU only: with --device cuda use none "
                             "(or auto)")
        if self.quantization in FLOAT32_ACTIVATIONS and self.dtype not in ("auto", "float32"):
            raise ValueError(
                f"quantization {self.quantization} runs float32 activations: use --dtype float32 "
                "(or auto)"
            )
        if (
            self.num_threads is not None
            and self.decode_threads is not None
            and self.decode_threads > self.num_threads
        ):
            raise ValueError(f"decode_threads ({self.decode_threads}) must not exceed num_threads ({self.num_threads})")


# ------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ImageConfig:
    """The visual-token budget (inputs/budget.py applies it), the limits checked before anything is
    decoded, and where images may come from."""

    image_max_tokens: int = field(default=1280, metadata=option(
        "visual tokens per image at most (the cap; images are resized to fit, aspect ratio kept; requests may ask "
        "for less, never more); 16384 = Qwen2-VL's processor default", ge=1))
    image_min_tokens: int = field(default=4, metadata=option(
        "visual tokens per image at least (smaller images are scaled up)"))
    image_low_detail_tokens: int = field(default=256, metadata=option(
        "the per-image budget of image_url.detail=low", ge=1))
    max_images_per_request: int = field(default=16, metadata=option(
        "images one request may carry, counted before any is decoded; more gets HTTP 400", ge=0))
    max_image_pixels: int = field(default=40_000_000, metadata=option(
        "declared width x height per image, checked from the header before decoding; more gets HTTP 400",
        ge=1))
    max_image_bytes: int = field(default=20 * 2**20, metadata=option(
        "encoded bytes per image, checked before base64-decoding or reading it; more gets HTTP 400",
        parse=parse_bytes, ge=1))
    image_min_tokens_under_load: int = field(default=256, metadata=option(
        "with --ttft-slo: the smallest visual-token budget per image a request's budget is lowered to before it is "
        "refused (set it to what `firsttoken regress` accepted for this deployment)", ge=1))
    max_input_tokens: int | None = field(default=None, metadata=option(
        "prompt tokens (text + image + chat template) a request may bring; more gets HTTP 400 (default: only the "
        "context limit applies)", ge=1))
    allowed_media_dir: Path | None = field(
        default=None,
        metadata=option(
            "serve local image paths / file:// URLs only inside this directory (off by default)",
            parse=Path,
        ),
    )
    allowed_media_domains: tuple[str, ...] = field(default=(), metadata=option(
        "comma-separated hosts whose http(s) image URLs the server may fetch (off by default); never from "
        "loopback, private, link-local or metadata addresses, checked after DNS and on every redirect",
        parse=_csv, shown="none"))
    media_fetch_timeout_s: float = field(
        default=5.0,
        metadata=option(
            "seconds one remote image fetch may take, redirects included",
            flag="--media-fetch-timeout",
            gt=0,
        ),
    )

    def __post_init__(self) -> None:
        _check_options(self)
        if not 1 <= self.image_min_tokens <= self.image_max_tokens:
            raise ValueError("image_min_tokens must be >= 1 and <= image_max_tokens")


@dataclass(frozen=True)
class VideoConfig:
    """The video budget (inputs/video.py plans it from the container before any frame is decoded)
    and the limits checked on the header. Defaults follow Qwen's own utilities (qwen-vl-utils
    0.0.14: 2 fps, 4 to 768 frames, 128 to 768 tokens per two-frame grid) except the per-video cap,
    which is set for a first token in seconds rather than Qwen's ~115k tokens."""

    video_max_tokens: int = field(default=4096, metadata=option(
        "visual tokens per video at most: (frames / 2) x tokens per two-frame grid; frames are sampled sparser and "
        "smaller to fit (requests may ask for less via video_url.max_visual_tokens, never more)",
        ge=1))
    video_max_frames: int = field(default=768, metadata=option(
        "sampled frames per video at most (Qwen's FPS_MAX_FRAMES; requests may ask for less via max_frames)",
        ge=2))
    video_fps: float = field(default=2.0, metadata=option(
        "frames sampled per second of video (Qwen's default; requests may ask for less via video_url.fps)",
        gt=0))
    video_min_frame_tokens: int = field(default=128, metadata=option(
        "visual tokens per two-frame grid at least (Qwen's VIDEO_MIN_TOKEN_NUM): smaller frames are scaled up, and "
        "a video that cannot fit its frames at this size under --video-max-tokens gets fewer frames",
        ge=1))
    video_max_frame_tokens: int = field(default=768, metadata=option(
        "visual tokens per two-frame grid at most (Qwen's VIDEO_MAX_TOKEN_NUM)"))
    video_max_seconds: float = field(default=600.0, metadata=option(
        "duration per video, from the container before decoding (and from its packets, which a lying header cannot "
        "hide); longer gets HTTP 400", gt=0))
    max_video_source_frames: int = field(default=36_000, metadata=option(
        "frames a video's container may hold (10 min at 60 fps), counted from the header and the packets before "
        "decoding; more gets HTTP 400", ge=1))
    max_video_pixels: int = field(default=4096 * 4096, metadata=option(
        "declared width x height per video frame, checked from the header before decoding; more gets HTTP 400",
        ge=1))
    max_video_streams: int = field(default=16, metadata=option(
        "streams (tracks of any kind) a video's container may hold, counted from its structure before FFmpeg opens "
        "it (FFmpeg sets up a decoder per stream while probing); more gets HTTP 400", ge=1))
    max_video_bytes: int = field(default=256 * 2**20, metadata=option(
        "encoded bytes per video, checked before base64-decoding, reading or fetching it; more gets HTTP 400",
        parse=parse_bytes, ge=1))
    video_decode_timeout_s: float = field(default=30.0, metadata=option(
        "seconds reading a video's packets and decoding its sampled frames may take; longer gets HTTP 400",
        flag="--video-decode-timeout", gt=0))
    max_videos_per_request: int = field(default=2, metadata=option(
        "video parts one request may carry; more gets HTTP 400 before any is read", ge=0))

    def __post_init__(self) -> None:
        _check_options(self)
        if self.video_max_frame_tokens < self.video_min_frame_tokens:
            raise ValueError("video_max_frame_tokens must be >= video_min_frame_tokens")
        if self.video_max_tokens < self.video_min_frame_tokens:
            raise ValueError(
                "video_max_tokens must be >= video_min_frame_tokens (one two-frame grid at its "
                "smallest size)"
            )


# ------------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=option("address to bind"))
    port: int = field(default=8000, metadata=option("port to bind", ge=0, le=65535))
    max_request_bytes: int = field(
        default=64 * 2**20,
        metadata=option(
            "largest request body; larger gets HTTP 413 (base64 images are ~4/3 of their bytes)",
            parse=parse_bytes,
            ge=1,
        ),
    )
    max_concurrent_requests: int = field(default=0, metadata=option(
        "requests in flight at once (preprocessing + generation), all lanes; beyond it HTTP 429 (0: no cap; the "
        "per-lane queue bound usually suffices)", ge=0))
    request_body_timeout_s: float | None = field(default=60.0, metadata=option(
        "seconds from a request's headers to the last byte of its body; later gets HTTP 408 and the connection "
        "is closed (a body that never ends cannot hold a connection)",
        flag="--request-body-timeout", gt=0, unset="no limit"))
    request_header_timeout_s: float = field(default=30.0, metadata=option(
        "seconds a connection may take to send a request's headers; later it is closed",
        flag="--request-header-timeout", gt=0))
    shutdown_timeout_s: float = field(default=30.0, metadata=option(
        "on SIGTERM: seconds in-flight requests get to finish (new ones get 503) before the rest are aborted and "
        "the server exits 0", flag="--shutdown-timeout", gt=0))
    num_preprocess_threads: int = field(default=2, metadata=option(
        "threads per preprocessing pool (light and heavy requests have one each), off the event loop",
        flag="--preprocess-threads", ge=1))
    log_level: str = field(default="info", metadata=option("debug, info, warning, error"))
    log_format: str = field(default="text", metadata=option(
        "server log lines: text or json (one object per line); both carry the request id"))
    request_log: Path | None = field(default=None, metadata=option(
        "append one JSON line per finished request (outcome, sizes, TTFT phases) to this file; no prompt text or "
        "image bytes", parse=Path))
    request_log_content: bool = field(default=False, metadata=option(
        "also write each prompt's text and image hashes to the request log"))
    stats_window_s: float = field(
        default=300.0,
        metadata=option(
            "seconds of finished requests that GET /stats and /dashboard summarise",
            flag="--stats-window",
            gt=0,
        ),
    )
    api_key: str | None = field(default=None, metadata=option(
        "require 'Authorization: Bearer KEY' on every route but /health and /dashboard (default: "
        "$FIRSTTOKEN_API_KEY; unset = open)", shown="$FIRSTTOKEN_API_KEY"))

    def __post_init__(self) -> None:
        _check_options(self)


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = field(default=None, metadata=option(
        "checkpoint directory (Hugging Face layout) or Hugging Face repo id (resolved from the local HF cache, "
        "downloaded when online); default: the built-in tiny demo checkpoint with random weights, which answers "
        "nonsense", shown="demo"))
    served_model_name: str | None = field(default=None, metadata=option(
        "model id clients must send (default: the repo id, or the directory name)"))
    chat_template: Path | None = field(default=None, metadata=option(
        "a Jinja chat template file to use instead of the checkpoint's", parse=Path))
    engine: EngineConfig = field(default_factory=EngineConfig)
    images: ImageConfig = field(default_factory=ImageConfig)
    videos: VideoConfig = field(default_factory=VideoConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


# -------------------------------------------------------------------------------------------- flags


@dataclass(frozen=True)
class ConfigFlag:
    """One leaf field of the tree as a command-line flag."""

    path: tuple[str, ...]  # ("engine", "cache", "kv_cache_memory_bytes")
    flag: str  # --kv-cache-memory
    parse: Callable[[str], Any] | None  # None: a switch (store_true, or store_false for switch_off)
    default: Any
    help: str
    shown: str  # the default as --help prints it
    switch_off: bool = False
    choices: tuple[str, ...] = ()  # a Literal field's values, in its type's order

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def field_name(self) -> str:
        return self.path[-1]


def config_flags(cls: type = ServeConfig, prefix: tuple[str, ...] = ()) -> Iterator[ConfigFlag]:
    """Every leaf of the tree rooted at ``cls``, in declaration order."""
    hints = _type_hints(cls)
    for f in fields(cls):
        default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
        if is_dataclass(default):
            yield from config_flags(type(default), (*prefix, f.name))
            continue
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        is_switch = f.type in ("bool", bool)
        parse = None if is_switch else meta.get("parse") or _parser_of(f.type)
        shown = meta.get("shown") or _shown(default, parse)
        yield ConfigFlag((*prefix, f.name), flag, parse, default, meta.get("help", ""), shown,
                         bool(meta.get("switch_off")), choices_of(hints[f.name]))


def flag_for_field(field_name: str, cls: type = ServeConfig) -> str | None:
    """The flag that sets a config field (ValueErrors name fields; users typed flags)."""
    return next((f.flag for f in config_flags(cls) if f.field_name == field_name), None)


def build_config(values: dict[str, Any], cls: type = ServeConfig) -> Any:
    """The tree from flag values by dest (missing ones keep their default); ValueError names the bad
    field."""
    return _build(cls, (), {f.path: values.get(f.dest, f.default) for f in config_flags(cls)})


def config_from_options(base: dict[str, Any] | None = None, **options: Any) -> ServeConfig:
    """The tree from options named by flag dest (``kv_cache_memory=2**24``,
    ``no_prefix_cache=True``), values as parsed or as the flag's text (``kv_cache_memory="16MiB"``,
    ``allowed_media_domains="a.com,b.org"``). ``base``: values already parsed (an argparse
    namespace's dict, where switches are False unless given). ValueError names the field of a bad
    value or the unknown option."""
    flags = {f.dest: f for f in config_flags()}
    unknown = set(options) - set(flags)
    if unknown:
        raise ValueError(f"unknown options: {sorted(unknown)}; known: {sorted(flags)}")
    values = {k: v for k, v in (base or {}).items() if k in flags}
    for dest, value in options.items():
        f = flags[dest]
        if isinstance(value, str) and f.parse not in (None, str):
            value = f.parse(value)
        values[dest] = value
    # a switch's value says whether its flag was given: the field's non-default value
    for f in flags.values():
        if f.parse is None and f.dest in values:
            values[f.dest] = (not values[f.dest]) if f.switch_off else bool(values[f.dest])
    return build_config(values)


def _build(cls: type, prefix: tuple[str, ...], by_path: dict[tuple[str, ...], Any]) -> Any:
    kwargs = {}
    for f in fields(cls):
        path = (*prefix, f.name)
        if path in by_path:
            kwargs[f.name] = by_path[path]
        else:
            kwargs[f.name] = _build(type(f.default_factory()), path, by_path)  # type: ignore[misc]
    return cls(**kwargs)


def _parser_of(annotation: Any) -> Callable[[str], Any]:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _shown(default: Any, parse: Callable[[str], Any] | None) -> str:
    if default is None:
        return "none"
    if parse is parse_bytes:
        return format_size(default)
    return str(default)


# --------------------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a checkpoint ships in generation_config.json; the server honours them."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "GenerationDefaults":
        path = Path(model_dir) / "generation_config.json"
        if not path.exists():
            return cls()
        with open(path) as f:
            d = json.load(f)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        do_sample = d.get("do_sample", True)
        return cls(
            eos_token_ids=eos_ids,
            temperature=float(d.get("temperature", 1.0)) if do_sample else 0.0,
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k") or 0),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            extra={
                k: v
                for k, v in d.items()
                if k not in {"eos_token_id", "temperature", "top_p", "top_k"}
            },
        )
