"""make-model --family qwen2.5-vl writes checkpoints transformers loads unchanged, in both layouts, with the family's
real config fields; our parser reads the published Qwen2.5-VL-7B-Instruct config.json and refuses what we do not
serve by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from firsttoken.cli.main import main as cli_main
from firsttoken.models.checkpoint import make_model
from firsttoken.models.recipe import TOKEN_IDS
from firsttoken.models.model_config import ConfigError, ModelConfig
from firsttoken.models.registry import family_of, load_model_config, model_config_from_dict
from tests.published_configs import QWEN25_VL_7B_INSTRUCT

FAMILY = "qwen2.5-vl"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {layout: make_model(tmp_path_factory.mktemp(f"q25-{layout}"), size="tiny", seed=0, layout=layout,
                               shards=2 if layout == "original" else 1, family=FAMILY)
            for layout in ("transformers", "original")}


def test_transformers_loads_both_layouts_unchanged_with_identical_logits(checkpoints) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["transformers"])
    processor = AutoImageProcessor.from_pretrained(checkpoints["transformers"])
    pixels = processor(images=[Image.new("RGB", (140, 84), (200, 40, 40))], return_tensors="pt")
    num_pads = int(pixels["image_grid_thw"].prod()) // 4
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(text.replace("<|image_pad|>", "<|image_pad|>" * num_pads))])
    logits = []
    for layout, model_dir in checkpoints.items():
        model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], layout
        assert model.config.vision_config.window_size == 112
        assert list(model.config.vision_config.fullatt_block_indexes) == [1, 3]
        assert model.config.vision_config.hidden_act == "silu"
        with torch.no_grad():
            logits.append(model.eval()(input_ids=input_ids, pixel_values=pixels["pixel_values"],
                                       image_grid_thw=pixels["image_grid_thw"],
                                       mm_token_type_ids=(input_ids == TOKEN_IDS["<|image_pad|>"]).long()).logits)
    assert torch.equal(logits[0], logits[1])


def test_files_name_weights_as_the_release_does(checkpoints) -> None:
    original = checkpoints["original"]
    names = set(json.loads((original / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "lm_head.weight",
            "visual.patch_embed.proj.weight", "visual.blocks.0.mlp.gate_proj.bias",
            "visual.blocks.3.mlp.up_proj.weight", "visual.blocks.0.mlp.down_proj.bias", "visual.blocks.0.norm1.weight",
            "visual.merger.ln_q.weight", "visual.merger.mlp.2.weight"} <= names
    assert not any(n.startswith(("model.language_model.", "model.visual.")) or "ln_q.bias" in n for n in names)
    config = json.loads((original / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and "text_config" not in config
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    vision = config["vision_config"]
    assert (vision["in_chans"], vision["spatial_patch_size"], vision["window_size"]) == (3, 14, 112)
    assert (vision["depth"], vision["fullatt_block_indexes"], vision["out_hidden_size"]) == (4, [1, 3], 64)
    pre = json.loads((original / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["processor_class"]) == (14, 2, "Qwen2_5_VLProcessor")


def test_both_layouts_parse_to_the_same_config(checkpoints) -> None:
    new, old = (load_model_config(checkpoints[layout]) for layout in ("transformers", "original"))
    assert (new.layout, old.layout) == ("transformers", "original")
    assert new == ModelConfig(**{**old.__dict__, "layout": "transformers"})
    assert family_of(checkpoints["original"]).name == new.family == FAMILY
    v = new.vision
    assert (v.depth, v.embed_dim, v.num_heads, v.intermediate_size, v.out_hidden_size) == (4, 32, 2, 88, 64)
    assert (v.window_size, v.fullatt_block_indexes, v.hidden_act) == (112, (1, 3), "silu")


def test_published_7b_config_parses_to_its_shapes() -> None:
    config = model_config_from_dict(QWEN25_VL_7B_INSTRUCT)
    assert config.family == FAMILY and config.layout == "original"
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (
        3584, 28, 4, 128)
    assert config.mrope_section == (16, 24, 24) and config.rope_theta == 1e6
    assert config.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2  # GQA: 4 KV heads
    v = config.vision
    assert (v.depth, v.embed_dim, v.num_heads, v.intermediate_size, v.out_hidden_size) == (32, 1280, 16, 3420, 3584)
    assert (v.window_size, v.fullatt_block_indexes, v.patch_size, v.pixels_per_token) == (112, (7, 15, 23, 31), 14, 28)
    transformers_layout = {
        "architectures": QWEN25_VL_7B_INSTRUCT["architectures"], "model_type": "qwen2_5_vl",
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": False,
        "text_config": {k: QWEN25_VL_7B_INSTRUCT[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                      "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                      "max_position_embeddings", "rms_norm_eps", "eos_token_id")}
        | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
        "vision_config": {k: v for k, v in QWEN25_VL_7B_INSTRUCT["vision_config"].items()
                          if k not in ("in_chans", "spatial_patch_size")} | {"in_channels": 3},
    }
    assert model_config_from_dict(transformers_layout) == ModelConfig(**{**config.__dict__, "layout": "transformers"})


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True}, "use_sliding_window is true; the decoder's sliding window is not supported"),
    ({"vision_config": {**QWEN25_VL_7B_INSTRUCT["vision_config"], "hidden_act": "gelu"}}, "hidden_act 'gelu' unsupported"),
    ({"vision_config": {**QWEN25_VL_7B_INSTRUCT["vision_config"], "window_size": 20}}, "window_size 20 is smaller than one"),
    ({"vision_config": {**QWEN25_VL_7B_INSTRUCT["vision_config"], "depth": 4}}, "block index 7 is outside depth 4"),
    ({"vision_config": {**QWEN25_VL_7B_INSTRUCT["vision_config"], "out_hidden_size": 2048}}, "out_hidden_size 2048 !="),
    ({"vision_config": {**QWEN25_VL_7B_INSTRUCT["vision_config"], "rope_parameters": {"rope_theta": 5e5}}},
     "rope_theta 500000 unsupported"),
])
def test_what_we_do_not_serve_is_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_config_from_dict({**QWEN25_VL_7B_INSTRUCT, **change})


def test_cli_make_model_small_is_near_qwen2_vl_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["make-model", str(tmp_path / "q25"), "--family", FAMILY, "--size", "small",
                     "--layout", "original"]) == 0
    out = capsys.readouterr().out
    assert f"({FAMILY} small, seed 0, original layout, 1 shard(s))" in out
    params = json.loads((tmp_path / "q25" / "firsttoken_checkpoint.json").read_text())["params"]
    assert 40_000_000 <= params["total"] <= 50_000_000  # Qwen2-VL small: 44.0M
    vision = load_model_config(tmp_path / "q25").vision
    assert (vision.depth, vision.fullatt_block_indexes, vision.window_size) == (8, (3, 7), 112)
