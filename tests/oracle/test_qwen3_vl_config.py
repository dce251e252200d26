"""What only Qwen3-VL has, against transformers: interleaved M-RoPE tables, the releases' config.json layout, the
published 8B config's shapes, make-model's checkpoints in transformers' own classes, and the refusals. Its parity
with transformers (DeepStack included) is test_family_parity.py's and test_engine_oracle.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from firsttoken.loading.loader import load_model
from firsttoken.models.checkpoint import make_model
from firsttoken.models.layers import mrope_cos_sin
from firsttoken.models.mrope import compute_mrope_positions
from firsttoken.models.qwen3_vl_checkpoint import SIZES, build_hf_config
from firsttoken.models.registry import load_model_config
from tests.oracle.parity import checkpoint_processor, in_pixels, make_prompt

THREE_IMAGES = [(9, 4), (4, 7), (2, 2)]  # (width, height) in visual tokens


def reference_model(model_dir: Path):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3-vl-tiny"), size="tiny", seed=0, family="qwen3-vl", shards=2)


@pytest.fixture(scope="module")
def ours(model_dir: Path):
    return load_model(model_dir, torch.float32)


def test_interleaved_mrope_tables_equal_the_reference_rotary(ours, model_dir) -> None:
    processor = checkpoint_processor(model_dir, ours.config)
    prompt = make_prompt(ours.config, in_pixels(ours.config, THREE_IMAGES), 0, processor)
    positions = compute_mrope_positions(prompt.ids, prompt.grid_thw, ours.config).positions
    c = ours.config
    cos, sin = mrope_cos_sin(positions, c.head_dim, c.rope_theta, c.mrope_section, torch.float32, interleaved=True)
    rotary = reference_model(model_dir).model.language_model.rotary_emb
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_release_config_layout_loads_the_same_model(ours, tmp_path: Path) -> None:
    """The releases' config.json (rope_scaling + rope_theta, vision model_type "qwen3_vl") parses to the same
    architecture as transformers 5's and loads the same weights (its logits: test_family_parity.py's layouts)."""
    original = make_model(tmp_path, size="tiny", seed=0, family="qwen3-vl", layout="original")
    config = load_model_config(original)
    assert config.layout == "original" and ours.config.layout == "transformers"
    assert config == dataclasses.replace(ours.config, layout="original")
    model = load_model(original, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ours.state_dict().values()))


@pytest.mark.parametrize("layout", ["transformers", "original"])
def test_make_model_checkpoint_loads_unchanged_in_transformers_classes(model_dir, tmp_path, layout) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    from firsttoken.models.recipe import TOKEN_IDS, VOCAB_SIZE

    out = model_dir if layout == "transformers" else make_model(tmp_path, family="qwen3-vl", layout="original")
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.head_dim, text.hidden_size, text.num_attention_heads, text.vocab_size) == (32, 64, 4, VOCAB_SIZE)
    assert text.rope_parameters["rope_theta"] == 5_000_000
    assert text.rope_parameters["mrope_section"] == [6, 5, 5] and text.rope_parameters["mrope_interleaved"]
    assert list(vision.deepstack_visual_indexes) == [1, 2] and vision.depth == 4
    assert (vision.num_position_embeddings, vision.patch_size, vision.out_hidden_size) == (64, 16, 64)
    assert model.config.image_token_id == TOKEN_IDS["<|image_pad|>"] and not model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == TOKEN_IDS["<|image_pad|>"]
    processor = AutoImageProcessor.from_pretrained(out)
    assert (processor.patch_size, processor.merge_size, tuple(processor.image_mean), tuple(processor.image_std)) == (
        16, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (256 * 256, 4096 * 4096)
    config = load_model_config(out)
    assert config.vision.deepstack_visual_indexes == (1, 2) and config.mrope_interleaved and config.qk_norm
    assert (config.head_dim, config.rope_theta, config.image_processor.pixels_per_token) == (32, 5_000_000.0, 32)


def test_small_is_the_size_of_qwen2_vl_small() -> None:
    """Same language model as Qwen2-VL small (39M); the tower's three DeepStack mergers add ~5M."""
    from transformers import Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from firsttoken.models import checkpoint, qwen2_vl_checkpoint

    def count(model_class, config) -> tuple[int, int]:
        with torch.device("meta"):
            state = model_class(config).state_dict()
        counts = checkpoint.count_params(state)
        return counts.total, counts.language_model

    qwen3 = count(Qwen3VLForConditionalGeneration, build_hf_config(SIZES["small"]))
    qwen2_small = qwen2_vl_checkpoint.build_hf_config(qwen2_vl_checkpoint.SIZES["small"])
    qwen2 = count(Qwen2VLForConditionalGeneration, qwen2_small)
    print(f"small: qwen3-vl {qwen3[0]:,} parameters, qwen2-vl {qwen2[0]:,}")
    assert abs(qwen3[1] - qwen2[1]) / qwen2[1] < 0.01
    assert 1.0 < qwen3[0] / qwen2[0] < 1.15


def test_cli_make_model_family_qwen3_vl(tmp_path: Path, capsys) -> None:
    from firsttoken.cli.main import main as cli_main

    assert cli_main(["make-model", str(tmp_path / "m"), "--family", "qwen3-vl", "--layout", "original"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-vl tiny" in out and "original layout" in out
    assert load_model_config(tmp_path / "m").family == "qwen3-vl"


def test_moe_variant_and_unsupported_fields_are_refused_by_name(model_dir: Path) -> None:
    """Qwen3-VL-30B-A3B (MoE) is not served; a field this code would silently get wrong is a ConfigError."""
    import json

    from firsttoken.models.model_config import ConfigError
    from firsttoken.models.registry import model_config_from_dict

    config = json.loads((model_dir / "config.json").read_text())
    moe = {**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe"}
    with pytest.raises(ConfigError, match="Qwen3VLMoeForConditionalGeneration"):
        model_config_from_dict(moe)
    biased = {**config, "text_config": {**config["text_config"], "attention_bias": True}}
    with pytest.raises(ConfigError, match="attention_bias"):
        model_config_from_dict(biased)
    flat = {k: v for k, v in config.items() if k != "text_config"}
    with pytest.raises(ConfigError, match="text_config"):
        model_config_from_dict(flat)


QWEN3_VL_8B_CONFIG = {  # Qwen/Qwen3-VL-8B-Instruct's config.json as published (transformers 4.57 layout)
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_published_qwen3_vl_8b_config_builds_the_reference_shapes() -> None:
    """The release's config.json parses to its architecture, and our module built from it (on the meta device)
    has every parameter transformers' has: the same count per tower."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from firsttoken.attention.registry import get_backend
    from firsttoken.models.registry import family_of_config, model_config_from_dict

    config = model_config_from_dict(QWEN3_VL_8B_CONFIG)
    assert (config.layout, config.head_dim, config.num_key_value_heads, config.rope_theta) == (
        "original", 128, 8, 5_000_000.0)
    assert config.mrope_section == (24, 20, 20) and config.mrope_interleaved and config.qk_norm
    assert config.vision.deepstack_visual_indexes == (8, 16, 24) and config.vision.num_position_embeddings == 2304
    assert config.kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2
    assert config.image_processor.pixels_per_token == 32  # no preprocessor_config.json: the family's defaults
    with torch.device("meta"):
        ours = family_of_config(QWEN3_VL_8B_CONFIG).build(config, get_backend("sdpa"))
        reference = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**QWEN3_VL_8B_CONFIG))

    def count(model: torch.nn.Module, vision: bool) -> int:
        return sum(p.numel() for n, p in model.named_parameters() if ("visual." in n) == vision)

    assert count(ours, vision=True) == count(reference, vision=True)
    assert count(ours, vision=False) == count(reference, vision=False)
