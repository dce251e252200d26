"""Prefill MFU: the language model's prefill and the vision tower, FLOPs over time against the matmul peak measured
in the same run (square products in the timing dtype: bf16 on a device).

The prompt is the seed mix's heaviest class, three 1024x1024 images beside ~800 tokens of text, on the Qwen2-VL-7B
shape (benchmarks/roofline.py's ``build_prompt``: 4,913 tokens there), its language model in one pass (no chunks)
over a paged KV cache through the SDPA backend, the vision tower image by image through its encode protocol, as
the runner drives both (roofline.py's ``lm_prefill`` and ``encode``). FLOPs are roofline.py's ``count_flops``
(a multiply-add is 2; causal attention counts only the keys a query sees; norms and activations count 0). Times
are medians of ``repeats`` after a warm-up, the device synchronized around each.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from firsttoken.inputs.budget import REFERENCE_MAX_TOKENS
from roofline import build_prompt, count_flops, encode, lm_prefill
from setting import DTYPES, Setting, gate_verdict, median, model_of
from step import Recorder

FAMILY = "qwen2-vl"  # roofline.py counts Qwen2-VL's parts
LM_PARTS = ("lm_linear", "lm_attention", "lm_head")
VISION_PARTS = ("patch_embed", "vision_linear", "vision_attention", "merger")


def matmul_tflops(setting: Setting, dtype: torch.dtype) -> float:
    """Median TFLOP/s of a square product of random operands (never zeros: they run faster than data)."""
    side = setting.matmul_side
    a, b = (torch.randn(side, side, device=setting.device).to(dtype) for _ in range(2))
    times = [setting.seconds(lambda: a @ b)[1] for _ in range(3 + 4 * setting.repeats)][3:]
    return 2 * side**3 / median(times) / 1e12


def run(setting: Setting, rec: Recorder, results: Path) -> None:
    dtype = setting.timing_dtype
    torch_dtype = DTYPES[dtype][1]
    rec.put("dtype", dtype)
    rec.put("n", setting.repeats)
    rec.put("shape", setting.shape_name(FAMILY))
    rec.put("peak_shape", f"{setting.matmul_side}^3 {dtype}")
    rec.put("peak_tflops", matmul_tflops(setting, torch_dtype))
    ok, why = gate_verdict(results, "sdpa")
    if not ok:
        for key in ("lm.tokens", "lm.tflop", "lm.s", "vision.patches", "vision.tflop", "vision.s"):
            rec.skip(key, why)
        return
    llm = setting.llm(setting.model_dir(FAMILY), dtype, "sdpa")
    model, config = model_of(llm), llm.engine.model_config
    side = setting.image_side_px
    prompt = build_prompt(config, [(side, side)] * 3, setting.text_tokens, REFERENCE_MAX_TOKENS, 0)
    flops = count_flops(config, prompt)

    def vision() -> list:
        with torch.inference_mode():
            return [encode(model, image, lambda _group: nullcontext()) for image in prompt.images]

    embeds = vision()
    lm_prefill(model, config, prompt, embeds)  # warm-up (and the vision tower's, above)
    vision_s = [setting.seconds(vision)[1] for _ in range(setting.repeats)]
    lm_s = [setting.seconds(lambda: lm_prefill(model, config, prompt, embeds))[1] for _ in range(setting.repeats)]
    rec.put("lm.tokens", len(prompt.ids))
    rec.put("lm.tflop", sum(flops[p] for p in LM_PARTS) / 1e12)
    rec.put("lm.s", median(lm_s))
    rec.put("vision.patches", sum(t * h * w for t, h, w in prompt.grids))
    rec.put("vision.tflop", sum(flops[p] for p in VISION_PARTS) / 1e12)
    rec.put("vision.s", median(vision_s))
    rec.note(flops_by_part=flops, lm_runs_s=lm_s, vision_runs_s=vision_s, grids=prompt.grids,
             peak_after_tflops=matmul_tflops(setting, torch_dtype))  # the peak again: did the clocks move?
