"""The GPU table, declared once: its steps in run order with their time bounds, the keys each step writes, and the
targets the summary reads off those keys. run.sh runs the steps in this order, benchmarks/gpu/step.py refuses a key
that is not declared here and a step that ends without one, summary.py reads nothing else, and the smoke test checks
that a smoke run writes every key. Imports nothing outside the standard library (run.sh and the tests read it).

Key names: "<part>.<part>..." strings; a value is a number, a string, a bool or a small dict (the gate's cases), and
null only where the step's JSON says why under ``why[key]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

MODELS = ("qwen2-vl", "qwen2.5-vl")  # families: their 7B-Instruct shapes on a device, their tiny shapes in --smoke
CLASSES = ("text", "1img", "3img")  # the seed mix: ~800 tokens of text, beside one or three 1024x1024 images
BACKENDS = ("sdpa", "triton")  # --attention-backend
GATE_DTYPES = ("bf16", "fp32")
GATE_PROMPTS = ("text", "image")  # a short text; a short question beside one image
DECODE_BATCHES = (1, 16, 64)
# (name, attention backend, --cuda-graphs): graphs replay only the triton backend's decode (docs/gpu.md)
DECODE_CONFIGS = (("graphs_on", "triton", "auto"), ("graphs_off", "triton", "off"), ("sdpa", "sdpa", "off"))
SERVED_CONFIGS = ("default", "fcfs")  # default flags (first: calibrated on); --scheduling fcfs (the seed's start)
SERVED_UTILIZATION = 0.6  # of the capacity measured in the run


@dataclass(frozen=True)
class StepSpec:
    name: str
    device_limit_s: int  # run.sh's `timeout` on a GPU: the table's steps sum to at most 8 minutes with the setup
    smoke_limit_s: int  # the same with --smoke (the CPU standing in, tiny shapes)
    keys: tuple[str, ...]
    what: str


def gate_cases(backend: str) -> tuple[str, ...]:
    """The gate's keys that check ``backend``: every dtype and prompt."""
    return tuple(f"{d}.{backend}.{p}" for d in GATE_DTYPES for p in GATE_PROMPTS)


def backend_verdict(gate_values: dict, backend: str) -> tuple[bool, str]:
    """(whether the gate passed ``backend``, why not), from its cases alone: a gate stopped after checking one
    backend in full still lets the timing steps measure that one."""
    cases = {key: gate_values.get(key) for key in gate_cases(backend)}
    failed = [key for key, case in cases.items() if case is not None and case["verdict"] == "mismatch"]
    if failed:
        return False, f"the gate failed {', '.join(failed)}"
    unchecked = [key for key, case in cases.items() if case is None]
    if unchecked:
        return False, f"the gate did not check {', '.join(unchecked)}"
    return True, ""


def _gate_keys() -> tuple[str, ...]:
    cases = tuple(key for b in BACKENDS for key in gate_cases(b))  # checked backend by backend, sdpa first
    return (*cases, *(f"{b}.passed" for b in BACKENDS), "passed", "rule")


def _ttft_keys() -> tuple[str, ...]:
    per_cell = ("transformers_s", *(f"{b}_s" for b in BACKENDS), "prompt_tokens")
    return (*(f"{m}.{c}.{k}" for m in MODELS for c in CLASSES for k in per_cell), "n", "dtype", "shapes")


def _decode_keys() -> tuple[str, ...]:
    rows = tuple(f"batch{b}.{name}.tokens_per_s" for b in DECODE_BATCHES for name, _, _ in DECODE_CONFIGS)
    return (*rows, "copy_gbps", "weight_bytes", "new_tokens", "graph_sizes", "dtype", "shape")


def _served_keys() -> tuple[str, ...]:
    per_config = tuple(f"{cfg}.{c}.{k}" for cfg in SERVED_CONFIGS for c in CLASSES for k in ("p99_s", "n"))
    return (*per_config, *(f"unloaded.{c}.ttft_s" for c in CLASSES), "capacity_rps", "rate_rps", "utilization",
            "num_requests", "output_tokens", "shape")


# run.sh's setup before the table: installing the carried wheels (device runs only), then the device probe;
# (name, device bound s, smoke bound s). With the table's steps the device bounds sum to 480 s, the 8 minutes.
SETUP = (("wheels", 40, 120), ("device", 15, 60))
SMOKE_SCALE_ENV = "FIRSTTOKEN_GPU_TABLE_SMOKE_SCALE"
STEPS: tuple[StepSpec, ...] = (
    StepSpec("gate", 100, 120, _gate_keys(),
             "ours vs transformers' teacher-forced logits on our greedy tokens, bf16 and fp32, both backends"),
    StepSpec("ttft", 105, 120, _ttft_keys(), "unloaded TTFT: transformers' generate vs our SDPA and Triton backends"),
    StepSpec("mfu", 25, 60, ("peak_tflops", "peak_shape", "lm.tokens", "lm.tflop", "lm.s", "vision.patches",
                             "vision.tflop", "vision.s", "n", "dtype", "shape"),
             "language-model prefill and vision tower against the matmul peak measured in the run"),
    StepSpec("decode", 65, 90, _decode_keys(),
             "decode tokens/s at batch 1, 16, 64, graphs on and off, against the weight-bytes roofline"),
    StepSpec("served", 130, 150, _served_keys(),
             "the seed mix through firsttoken bench at U 0.6 of the measured capacity, default flags vs fcfs"),
)
STEP_NAMES = tuple(s.name for s in STEPS)
TIMING_STEPS = STEP_NAMES[1:]  # skipped (per backend) where the gate did not pass


def spec(name: str) -> StepSpec:
    for s in STEPS:
        if s.name == name:
            return s
    raise KeyError(f"no step {name!r}; steps: {', '.join(STEP_NAMES)}")


@dataclass(frozen=True)
class Target:
    """One line of the summary: ``figure(values of keys)`` beside ``threshold``; met when it compares as ``op``
    says ("<=" or ">="). ``keys`` are the step's keys the figure reads (all must be non-null for a figure)."""

    label: str
    step: str
    keys: tuple[str, ...]
    figure: Callable[..., float]
    op: str
    threshold: float
    unit: str  # how the figure prints: "x" (a ratio) or "%" (a share)
    how: str  # the figure in words, for the summary's line


def _ttft_targets() -> list[Target]:
    return [Target(f"TTFT {m} {c}, {b} / transformers", "ttft",
                   (f"{m}.{c}.{b}_s", f"{m}.{c}.transformers_s"), lambda ours, theirs: ours / theirs, "<=", 0.5, "x",
                   f"median TTFT of our {b} backend over transformers' generate, same inputs")
            for m in MODELS for c in CLASSES for b in BACKENDS]


def _decode_targets() -> list[Target]:
    # roofline tokens/s = copy bandwidth / weight bytes; the figure is the measured share of it
    return [Target(f"decode batch 1, {name}, share of the roofline", "decode",
                   (f"batch1.{name}.tokens_per_s", "copy_gbps", "weight_bytes"),
                   lambda tps, gbps, nbytes: tps * nbytes / (gbps * 1e9), ">=", 0.7, "%",
                   "tokens/s over (copy bandwidth / weight bytes)")
            for name, _, _ in DECODE_CONFIGS]


TARGETS: tuple[Target, ...] = (
    *_ttft_targets(),
    Target("prefill MFU, language model", "mfu", ("lm.tflop", "lm.s", "peak_tflops"),
           lambda tflop, s, peak: tflop / s / peak, ">=", 0.5, "%", "FLOPs / time over the matmul peak of the run"),
    Target("prefill MFU, vision tower", "mfu", ("vision.tflop", "vision.s", "peak_tflops"),
           lambda tflop, s, peak: tflop / s / peak, ">=", 0.5, "%", "FLOPs / time over the matmul peak of the run"),
    *_decode_targets(),
    Target("served U 0.6, text P99 / unloaded TTFT", "served", ("default.text.p99_s", "unloaded.text.ttft_s"),
           lambda p99, unloaded: p99 / unloaded, "<=", 2.5, "x", "default flags' text P99 over its unloaded TTFT"),
    *(Target(f"served U 0.6, {c} P99 default / fcfs", "served", (f"default.{c}.p99_s", f"fcfs.{c}.p99_s"),
             lambda ours, fcfs: ours / fcfs, "<=", 1.05, "x", "default flags' P99 over fcfs's, same arrivals")
      for c in CLASSES[1:]),
)


@dataclass(frozen=True)
class Figure:
    """A figure the summary prints without a target."""

    label: str
    step: str
    key: str
    unit: str


FIGURES: tuple[Figure, ...] = tuple(
    Figure(f"decode batch {b}, {name}", "decode", f"batch{b}.{name}.tokens_per_s", "tokens/s")
    for b in DECODE_BATCHES[1:] for name, _, _ in DECODE_CONFIGS
)


def limits(smoke: bool) -> list[tuple[str, int]]:
    """(step, bound in seconds) in run order: the setup, then the table's steps."""
    # $FIRSTTOKEN_GPU_TABLE_SMOKE_SCALE stretches the smoke bounds (the CI test: a loaded CPU is not what it checks)
    scale = float(os.environ.get(SMOKE_SCALE_ENV, "1")) if smoke else 1.0
    setup = [(name, round(scale * smoke_s) if smoke else device_s) for name, device_s, smoke_s in SETUP]
    return setup + [(s.name, round(scale * s.smoke_limit_s) if smoke else s.device_limit_s) for s in STEPS]


if __name__ == "__main__":  # run.sh: `python manifest.py [--smoke]` prints "step seconds" lines in run order
    import sys

    for name, seconds in limits("--smoke" in sys.argv[1:]):
        print(name, seconds)
