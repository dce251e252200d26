"""A tiling family exact against transformers at three rungs of its budget ladder, through the real engine: one
3:1 photo cut into one tile (max_patches 1: no thumbnail), 1x2 tiles and a thumbnail (2) and 1x3 tiles and a
thumbnail (4), each beside a text prompt and a three-image prompt in one batch, chunks of 97 tokens ending
inside the tiles; greedy tokens and every prompt logprob (fp32). transformers' own image processor (PIL backend,
``crop_to_patches``, as InternVLProcessor asks) cuts the pixels at each rung."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from firsttoken.models.family import ModelFamily
from firsttoken.models.registry import family_named, load_model_config
from tests.oracle.parity import TILED_FAMILIES, image_kwargs
from tests.oracle.test_engine_oracle import (
    Prompt,
    engine_request,
    make_engine,
    make_prompt,
)

NUM_NEW = 4
WIDE = [(48, 16)]  # 1344 x 448 px at 28 px per visual token: 3:1
THREE = [(16, 16), (32, 16), (16, 32)]  # 448², 896 x 448, 448 x 896
TILES = {1: 1, 2: 3, 4: 4}  # max_patches -> the wide photo's tiles (crops, and the thumbnail beside more than one)


@pytest.fixture(scope="module", params=TILED_FAMILIES)
def family(request: pytest.FixtureRequest) -> ModelFamily:
    return family_named(request.param)


@pytest.fixture(scope="module")
def hf_model(family: ModelFamily, model_dir: Path):
    model_class = family.checkpoint.hf_model_class()
    return model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def expected(model, config, prompt: Prompt) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (full forwards, no cache: the model's definition) and the prompt's log-softmax."""
    out: list[int] = []
    logprobs = None
    with torch.no_grad():
        for _ in range(NUM_NEW):
            input_ids = torch.tensor([list(prompt.ids) + out])
            logits = model(input_ids=input_ids,
                           **image_kwargs(config, input_ids, prompt.pixel_values, list(prompt.grids))).logits[0]
            if logprobs is None:
                logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.append(int(logits[-1].argmax()))
    return out, logprobs


@pytest.mark.parametrize("max_patches", sorted(TILES))
def test_greedy_tokens_and_prompt_logprobs_match_transformers_at_each_rung(model_dir: Path, hf_model,
                                                                          max_patches: int) -> None:
    from transformers import AutoImageProcessor

    config = load_model_config(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil", crop_to_patches=True,
                                                   max_patches=max_patches)
    prompts = {"text": make_prompt(config, processor, [], seed=1), "wide": make_prompt(config, processor, WIDE, seed=3),
               "three": make_prompt(config, processor, THREE, seed=4)}
    assert prompts["wide"].grids[0][0] == TILES[max_patches]
    engine = make_engine(model_dir, 97)
    for name, prompt in prompts.items():
        r = engine_request(config, prompt, name)
        engine.add_request(replace(r, sampling=replace(r.sampling, max_tokens=NUM_NEW, prompt_logprobs=1)))
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    scored: dict[str, tuple] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.prompt_logprobs:
                scored[out.request_id] = out.prompt_logprobs
    assert engine.stats().kv_blocks_used == 0
    for name, prompt in prompts.items():
        want_tokens, logprobs = expected(hf_model, config, prompt)
        assert tokens[name] == want_tokens, name
        want = logprobs[torch.arange(len(prompt.ids) - 1), torch.tensor(prompt.ids[1:])]
        got = scored[name]
        assert [lp.token_id for lp in got] == list(prompt.ids[1:]), name
        assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=1e-4), name
