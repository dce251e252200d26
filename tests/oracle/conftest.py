"""Tiny random Qwen2-VL checkpoints written by transformers itself, shared by the oracle tests.

The shape is small enough that the whole oracle suite runs in well under a minute on 2 CPU cores, yet keeps
every feature that can go wrong: GQA (4 query heads over 2 KV heads), an uneven M-RoPE split (2, 3, 3), two
vision blocks with 2 heads and the 2x2 merger. lm_head is scaled by 20 so logits are peaked and greedy
token comparisons are not decided by 1e-6 noise (random weights otherwise give near-flat logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

LM_HEAD_SCALE = 20.0
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 1995, 1996, 1997, 1998


def tiny_hf_config(tie_word_embeddings: bool = False):
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=2000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1_000_000.0},
            eos_token_id=None,
            bos_token_id=None,
        ),
        vision_config=dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=4),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=tie_word_embeddings,
    )


def write_tiny_checkpoint(out_dir: Path, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(tiny_hf_config(tie_word_embeddings))
    if not tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers 5.24 ``save_pretrained`` output (original Qwen weight names: model.layers.*, visual.*)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_sharded_dir(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights renamed to the model.language_model.* / model.visual.* layout, in two shards + index."""
    out = tmp_path_factory.mktemp("tiny_qwen2_vl_sharded")
    tensors = load_file(str(tiny_qwen2_vl_dir / "model.safetensors"))
    renamed = {}
    for key, t in tensors.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model."):
            key = "model.language_model." + key[len("model.") :]
        renamed[key] = t
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in shard_keys}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard_keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((tiny_qwen2_vl_dir / "config.json").read_text())
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_vl_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2_vl_tied"), tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="module")
def kernel_built() -> None:
    """firsttoken's CPU kernels (firsttoken/kernels/cpu_linear.py) need an x86 CPU with AVX2 + FMA (every machine CI
    runs on) and a C compiler."""
    from firsttoken.kernels import cpu_linear
    from firsttoken.kernels.cpu_features import CpuFeatures
    from tests.conftest import require_program

    require_program("cc", "gcc", "gcc")
    assert CpuFeatures.detect().avx2_fma, "CI's machines have AVX2 + FMA; this one does not"
    assert cpu_linear.kernel_unavailable() is None
