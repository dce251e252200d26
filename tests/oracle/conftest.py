"""The family under test, and tiny random Qwen2-VL checkpoints written by transformers itself, shared by the oracle
tests.

``family`` is each family the registry serves at collection (a test module that registers one overrides it), and
``model_dir`` make_model's tiny checkpoint of it (two shards): the parity suites over every family
(test_family_parity.py, test_engine_oracle.py, test_vision_row_slices.py) take them.

The transformers-written checkpoints' shape is small, yet keeps every feature that can go wrong: GQA (4 query heads
over 2 KV heads), an uneven M-RoPE split (2, 3, 3), two vision blocks with 2 heads and the 2x2 merger. lm_head is
scaled by 20 so logits are peaked and greedy token comparisons are not decided by 1e-6 noise (random weights
otherwise give near-flat logits).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firsttoken.models.family import ModelFamily
from firsttoken.models.registry import families, family_named

LM_HEAD_SCALE = 20.0
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 1995, 1996, 1997, 1998


@pytest.fixture(scope="module", params=[f.name for f in families()])
def family(request: pytest.FixtureRequest) -> ModelFamily:
    return family_named(request.param)


@pytest.fixture(scope="module")
def model_dir(family: ModelFamily, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from firsttoken.models.checkpoint import make_model

    return make_model(tmp_path_factory.mktemp(family.name), size="tiny", seed=0, family=family.name, shards=2)


@pytest.fixture(scope="module")
def processor(model_dir: Path):
    from firsttoken.models.registry import load_model_config
    from tests.oracle.parity import checkpoint_processor

    return checkpoint_processor(model_dir, load_model_config(model_dir))


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
