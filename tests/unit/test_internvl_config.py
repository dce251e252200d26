"""InternVL's config.json and preprocessor_config.json as firsttoken reads them: the language model's variant from
text_config.model_type, the tiling from the preprocessor, tied embeddings from the top level (as transformers reads
them), 1-D positions over image pads, whole tiles for start-up's probe images, and clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from firsttoken.models.checkpoint import make_model
from firsttoken.models.internvl import parse_config, positions
from firsttoken.models.model_config import ConfigError, TileSpec


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    model_dir: Path = make_model(tmp_path_factory.mktemp("internvl"), size="tiny", family="internvl3.5")
    return (json.loads((model_dir / "config.json").read_text()),
            json.loads((model_dir / "preprocessor_config.json").read_text()))


def test_the_recipe_s_config_reads_as_a_qwen3_decoder_over_448_px_tiles(files) -> None:
    config_json, pre = files
    config = parse_config(config_json, pre)
    assert config.family == "internvl3.5"
    assert (config.qk_norm, config.attention_bias, config.tie_word_embeddings) == (True, False, False)
    assert config.image_processor.tiles == TileSpec(448, 1, 12)
    assert config.image_processor.tokens_per_tile == 256
    assert config.image_processor.grid_for(64) == (1, 32, 32)  # start-up's probe image: one tile
    assert config.image_processor.grid_for(1280) == (5, 32, 32)
    assert config.vision.spatial_merge_size == 2 and config.vision.temporal_patch_size == 1
    assert config.image_token_id == config_json["image_token_id"]
    assert config.vision_start_token_id == config_json["start_image_token_id"]


def test_a_qwen2_text_model_takes_biases_and_no_qk_norms_and_the_top_level_ties(files) -> None:
    config_json, pre = files
    text = {**config_json["text_config"], "model_type": "qwen2"}
    config = parse_config({**config_json, "text_config": text, "tie_word_embeddings": True}, pre)
    assert (config.qk_norm, config.attention_bias, config.tie_word_embeddings) == (False, True, True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, p: ({**c, "text_config": {**c["text_config"], "model_type": "llama"}}, p), "'llama' unsupported"),
        (lambda c, p: ({k: v for k, v in c.items() if k != "text_config"}, p), "text_config"),
        (lambda c, p: (c, {**p, "size": {"height": 384, "width": 384}}), "448x448 tiles"),
        (lambda c, p: ({**c, "vision_feature_select_strategy": "full"}, p), "'full' unsupported"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(files, change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(*change(*files))


def test_positions_are_1d_and_the_pads_must_match_the_tiles(files) -> None:
    config = parse_config(*files)
    pad = config.image_token_id
    ids = [5, 6, config.vision_start_token_id, *[pad] * 512, config.vision_end_token_id, 7]
    got = positions(ids, [(2, 32, 32)], config)
    assert torch.equal(got.positions, torch.arange(len(ids)).expand(3, -1)) and got.delta == 0
    with pytest.raises(ValueError, match="512 image pads"):
        positions(ids, [(1, 32, 32)], config)


def test_the_1b_release_has_its_published_parameter_count_and_makes_a_dummy_checkpoint_our_tokenizer_serves(
    tmp_path: Path,
) -> None:
    """InternVL3.5-1B-HF's shapes (tests/published_configs.py): on the meta device our module has exactly the
    release's parameters per part, transformers' class too; as a --load-format dummy checkpoint its image, start and
    end fields point at our tokenizer's <IMG_CONTEXT>, <img> and </img> (the release's config names only the first;
    its processor supplies the others), so the renderer starts."""
    from transformers import AutoTokenizer, InternVLConfig, InternVLForConditionalGeneration

    from firsttoken.inputs.render import PromptRenderer
    from firsttoken.models.checkpoint import make_dummy_model
    from firsttoken.models.registry import load_model_config
    from firsttoken.tools.model_shape import exact_param_counts
    from tests.published_configs import INTERNVL35_1B_HF, INTERNVL35_1B_PARAMS

    vision, projector, language = INTERNVL35_1B_PARAMS
    assert exact_param_counts(INTERNVL35_1B_HF) == (language, vision + projector)
    with torch.device("meta"):
        theirs = InternVLForConditionalGeneration(InternVLConfig(**INTERNVL35_1B_HF))
    assert sum(p.numel() for p in theirs.parameters()) == vision + projector + language
    model_dir = make_dummy_model(tmp_path / "internvl-1b", INTERNVL35_1B_HF)
    config = load_model_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [config.image_token_id, config.vision_start_token_id, config.vision_end_token_id] == \
        tokenizer.convert_tokens_to_ids(["<IMG_CONTEXT>", "<img>", "</img>"])
    assert (config.hidden_size, config.num_hidden_layers, config.vision.depth) == (1024, 28, 24)
    PromptRenderer(tokenizer, config)
