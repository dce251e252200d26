"""Helpers several test directories share."""

from __future__ import annotations

import time

from firsttoken.inputs.processor import InputProcessor
from firsttoken.types import EngineRequest


def process(processor: InputProcessor, req, request_id: str = "r1") -> EngineRequest:
    """An OpenAI request body (ChatCompletionRequest / CompletionRequest) through the processor, as the server does."""
    return processor.process(req.prompts()[0], req.to_sampling(), request_id, time.monotonic())


def assert_equal_keys_mean_equal_inputs(a: EngineRequest, b: EngineRequest, block_size: int) -> int:
    """The prefix cache's invariant over two prompts: wherever a full block of ``a`` and one of ``b`` have the same
    key (the scheduler's own, ``Request.ensure_block_hashes``), the two blocks sit at the same index and feed the
    model the same inputs there: token ids, vision inputs (which item's content, and which of its rows, at each
    token) and rotary positions (every M-RoPE row). Equal keys mean shared KV, so anything less serves one prompt
    the other's KV. Returns the number of blocks that shared a key."""
    from firsttoken.scheduler.request import Request

    keys_b = {key: j for j, key in enumerate(Request(b, arrival_seq=0).ensure_block_hashes(block_size))}
    num_shared = 0
    for i, key in enumerate(Request(a, arrival_seq=0).ensure_block_hashes(block_size)):
        if key not in keys_b:
            continue
        num_shared += 1
        lo, hi = i * block_size, (i + 1) * block_size
        where = f"block {i} of {a.request_id} shares its key with block {keys_b[key]} of {b.request_id}"
        assert keys_b[key] == i, where
        assert a.prompt_token_ids[lo:hi] == b.prompt_token_ids[lo:hi], f"{where}: other token ids"
        assert _vision_rows(a, lo, hi) == _vision_rows(b, lo, hi), f"{where}: other images or image rows"
        assert a.mrope_positions[:, lo:hi].tolist() == b.mrope_positions[:, lo:hi].tolist(), f"{where}: other positions"
    return num_shared


def _vision_rows(request: EngineRequest, lo: int, hi: int) -> list[tuple[str, int] | None]:
    """Per prompt index in [lo, hi): (content hash, row of that item's encoder output) where a vision item feeds the
    token's embedding, else None (the token id's own embedding)."""
    rows: list[tuple[str, int] | None] = [None] * (hi - lo)
    for im in request.images:
        for k in range(max(lo, im.offset), min(hi, im.end)):
            rows[k - lo] = (im.content_hash, k - im.offset)
    return rows


def make_processor(model_dir, max_model_len: int = 4096, **image_options) -> InputProcessor:
    """The tiny checkpoint's processor with the checkpoint's generation defaults; ``image_options`` are
    ImageConfig fields (budget, limits)."""
    from firsttoken.config import GenerationDefaults, ImageConfig
    from firsttoken.models.registry import load_model_config

    return InputProcessor(model_dir, load_model_config(model_dir), GenerationDefaults.from_pretrained(model_dir),
                          max_model_len=max_model_len, images=ImageConfig(**image_options))


class RecordingExecutor:
    """An engine's executor that keeps each step's batch (plain data: request ids, chunks, encoder work) before
    running it: ``engine.executor = RecordingExecutor(engine.executor)``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list = []  # ScheduledBatch per step, in order

    def execute(self, batch):
        self.batches.append(batch)
        return self.inner.execute(batch)

    def finish_step(self):
        return self.inner.finish_step()

    @property
    def encoder_cache_bytes(self) -> int:
        return self.inner.encoder_cache_bytes


def layers_with(model, method_type: type) -> dict[str, object]:
    """The model's linear layers (models/linear.py) whose method is a ``method_type``, by name."""
    from firsttoken.models.linear import Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear) and isinstance(m.method, method_type)}


def torch_layers(model) -> list[str]:
    """The names of the linear layers that compute with torch's product on their float weight (no kernel, no
    quantized copy): what a plain ``nn.Linear`` computes."""
    from firsttoken.models.linear import TorchLinear

    return list(layers_with(model, TorchLinear))


def machine_with_cpu(**cpu):
    """This machine (its kernels, built here, and torch's probes), deciding as a CPU with these ``CpuFeatures``
    fields would (``flags`` a set of /proc/cpuinfo flags), with no CUDA device (so --device auto is the CPU on a
    GPU machine too: these are the CPU's rules)."""
    from firsttoken.kernels.cpu_features import CpuFeatures
    from firsttoken.loading.plan_values import CudaFacts, Machine

    if "flags" in cpu:
        cpu["flags"] = frozenset(cpu["flags"])
    return Machine.detect().with_cpu(CpuFeatures(**cpu)).with_cuda(CudaFacts.absent("CPU rules' test machine"))


# The CPU classes this project meets, as /proc/cpuinfo would report them (the flags firsttoken decides by): tests of
# the resolve and plan rules run for each by injection (``machine_with_cpu(**CPU_CLASSES[name])``), whatever CPU
# they run on.
_AVX2 = {"avx2", "fma"}
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
CPU_CLASSES: dict[str, dict] = {
    "avx2": {"flags": _AVX2, "vendor": "AuthenticAMD"},  # e.g. EPYC Rome/Milan
    "avx512": {"flags": _AVX512, "vendor": "GenuineIntel"},  # e.g. Xeon Cascade Lake: AVX-512 without bf16
    "avx512-bf16": {"flags": _AVX512 | {"avx512_bf16"}, "vendor": "AuthenticAMD"},  # e.g. EPYC Genoa: no AMX
    "amx": {"flags": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
            "vendor": "GenuineIntel"},  # e.g. Xeon Sapphire Rapids
}


def cpu_features_of(name: str):
    """``CPU_CLASSES[name]`` as a ``CpuFeatures``."""
    from firsttoken.kernels.cpu_features import CpuFeatures

    spec = CPU_CLASSES[name]
    return CpuFeatures(flags=frozenset(spec["flags"]), vendor=spec["vendor"])
