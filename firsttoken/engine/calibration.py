"""Start-up calibration of the step-cost model: a handful of synthetic requests through the real
engine.

Before the first client arrives, the engine prefills random-token prompts of a few lengths alone
(prefill-only steps of different sizes, then decode-only steps), then all of them plus a small
synthetic image together (mixed steps with encoder work). Every step is timed and fitted as any
other step; the fit becomes the cost model's prior, so the time bound and predicted TTFTs are
sensible from the first request and keep adapting afterwards. Costs a few seconds on the small
checkpoint. Calibration feeds the cost model only: its steps and requests reach no observer
(metrics, /stats, the request log) and run on a scheduler of their own (``LLMEngine.calibrate``
drives them), so the serving scheduler's counters, prefix cache and encoder cache never see them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named
from firsttoken.scheduler.cost_model import CostModel
from firsttoken.types import EngineRequest, ImageItem, SamplingParams

log = logging.getLogger("firsttoken.engine")

TEXT_LENGTHS = (32, 256, 1024)
MAX_TOKENS = 3
IMAGE_TOKENS = 64  # a (1, 16, 16) grid at a 2x2 merge; a tiling family's least: one tile


def calibrate(run: Callable[[list[EngineRequest]], None], model: CostModel, config: ModelConfig,
              max_model_len: int) -> None:
    """Fit ``model`` on the synthetic requests, each batch driven to its end by ``run`` (the
    engine's steps, on a scheduler of its own, seen by no observer); its fit becomes the prior."""
    start = time.monotonic()
    try:
        warmup = calibration_requests(config, max_model_len, 2)[0].prompt_token_ids[:16]
        run([_request(config, "calibrate-warmup", warmup, ())])
        model.reset()  # the first steps pay one-off kernel set-up: not a cost to learn
        requests = calibration_requests(config, max_model_len, seed=0)
        # alone: prefill-only steps of three sizes, then decodes
        for request in requests[: len(TEXT_LENGTHS)]:
            run([request])
        # together: mixed steps with encoder work
        run(calibration_requests(config, max_model_len, seed=1))
        model.refit()
        model.prior = model.coef.copy()
    finally:
        run([])  # hands the runner what it may drop (the requests, the images' outputs)
    log.info("step-cost model calibrated in %.1f s: %s", time.monotonic() - start,
             {k: f"{v:.3g}" for k, v in model.fit().as_dict().items()})


def calibration_requests(config: ModelConfig, max_model_len: int,
                         seed: int) -> list[EngineRequest]:
    family = family_named(config.family)
    gen = torch.Generator().manual_seed(seed)
    limit = max_model_len - 8
    reserved = {
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    }
    vocab = min(config.vocab_size, 1000 + max(reserved))

    def text(n: int) -> list[int]:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        return [t if t not in reserved else 0 for t in ids]

    out = []
    for i, n in enumerate(TEXT_LENGTHS):
        ids = text(min(n, limit))
        out.append(_request(config, f"calibrate-{seed}-text{i}", ids, ()))
    grid = config.image_processor.grid_for(IMAGE_TOKENS)
    t, h, w = grid
    merge = config.vision.spatial_merge_size
    num_tokens = t * h * w // merge**2
    if 40 + num_tokens < limit:
        p = config.image_processor
        pixels = torch.randn(
            (t * h * w, 3 * p.temporal_patch_size * p.patch_size**2), generator=gen
        )
        ids = text(16) + [config.vision_start_token_id] + [config.image_token_id] * num_tokens
        ids += [config.vision_end_token_id] + text(16)
        image = ImageItem(f"calibration-image-{seed}", 17, num_tokens, grid,
                          family.encoder_units(config.vision, grid), pixels)
        out.append(_request(config, f"calibrate-{seed}-image", ids, (image,)))
    return out


def _request(
    config: ModelConfig, request_id: str, ids: list[int], images: tuple[ImageItem, ...]
) -> EngineRequest:
    positions = family_named(config.family).positions(ids, [im.grid_thw for im in images], config)
    now = time.monotonic()
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return EngineRequest(
        request_id, tuple(ids), images, positions.positions, positions.delta, sampling, now, now
    )
