"""Start-up calibration of the step-cost model: a handful of synthetic requests through the real
engine.

Before the first client arrives, the engine prefills random-token prompts of a few lengths alone
(prefill-only steps of different sizes, then decode-only steps), then all of them plus a small
synthetic image together (mixed steps with encoder work). Every step is timed and fitted as any
other step; the fit becomes the cost model's prior, so the time bound and predicted TTFTs are
sensible from the first request and keep adapting afterwards. Costs a few seconds on the small
checkpoint. Calibration feeds the cost model only: its steps and requests reach no observer
(metrics, /stats, the request log) and run on a scheduler of their own (``LLMEngine.calibrate``), so
the serving scheduler's counters, prefix cache and encoder cache never see them.
"""

from __future__ import annotations

import logging
import time

import torch

from firsttoken.metrics.stats import NullObserver
from firsttoken.models.registry import family_named
from firsttoken.types import EngineRequest, ImageItem, SamplingParams

log = logging.getLogger("firsttoken.engine")

TEXT_LENGTHS = (32, 256, 1024)
MAX_TOKENS = 3
IMAGE_GRID = (1, 16, 16)  # patches: 64 visual tokens at a 2x2 merge


# engine: LLMEngine, on a scratch scheduler (engine.py imports this module)
def calibrate(engine) -> None:
    start = time.monotonic()
    model = engine.cost_model
    observer, engine.observer = engine.observer, NullObserver()
    try:
        _run(
            engine,
            [
                _request(
                    engine,
                    "calibrate-warmup",
                    calibration_requests(engine, 2)[0].prompt_token_ids[:16],
                    (),
                )
            ],
        )
        model.reset()  # the first steps pay one-off kernel set-up: not a cost to learn
        requests = calibration_requests(engine, seed=0)
        # alone: prefill-only steps of three sizes, then decodes
        for request in requests[: len(TEXT_LENGTHS)]:
            _run(engine, [request])
        # together: mixed steps with encoder work
        _run(engine, calibration_requests(engine, seed=1))
        model.refit()
        model.prior = model.coef.copy()
    finally:
        _run(engine, [])  # hands the runner what it may drop (the requests, the images' outputs)
        engine.observer = observer
    log.info("step-cost model calibrated in %.1f s: %s", time.monotonic() - start,
             {k: f"{v:.3g}" for k, v in model.fit().as_dict().items()})


def calibration_requests(engine, seed: int) -> list[EngineRequest]:
    config = engine.model_config
    family = family_named(config.family)
    gen = torch.Generator().manual_seed(seed)
    limit = engine.max_model_len - 8
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
        out.append(_request(engine, f"calibrate-{seed}-text{i}", ids, ()))
    t, h, w = IMAGE_GRID
    merge = config.vision.spatial_merge_size
    num_tokens = t * h * w // merge**2
    if 40 + num_tokens < limit:
        p = config.image_processor
        pixels = torch.randn(
            (t * h * w, 3 * p.temporal_patch_size * p.patch_size**2), generator=gen
        )
        ids = text(16) + [config.vision_start_token_id] + [config.image_token_id] * num_tokens
        ids += [config.vision_end_token_id] + text(16)
        image = ImageItem(f"calibration-image-{seed}", 17, num_tokens, IMAGE_GRID,
                          family.encoder_units(config.vision, IMAGE_GRID), pixels)
        out.append(_request(engine, f"calibrate-{seed}-image", ids, (image,)))
    return out


def _request(
    engine, request_id: str, ids: list[int], images: tuple[ImageItem, ...]
) -> EngineRequest:
    config = engine.model_config
    positions = family_named(config.family).positions(ids, [im.grid_thw for im in images], config)
    now = time.monotonic()
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return EngineRequest(
        request_id, tuple(ids), images, positions.positions, positions.delta, sampling, now, now
    )


def _run(engine, requests: list[EngineRequest]) -> None:
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
