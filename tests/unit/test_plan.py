"""firsttoken plan: its own arithmetic held against the real scheduler (the oracle) and the real checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from firsttoken.cli.main import main
from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.models.registry import model_config_from_dict
from firsttoken.engine.request import EngineRequest, Timeline
from firsttoken.sampling.params import SamplingParams
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.scheduler import Scheduler
from firsttoken.tools.plan import ModelShape, PlanInputs, make_plan, parse_bytes

QWEN25_VL_7B = {
    "model_type": "qwen2_5_vl", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 128000, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "in_chans": 3},
}
QWEN2_VL_2B = {
    "model_type": "qwen2_vl", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
}
# A shape without GQA and a tiny one, so the oracle also sees small pools and odd block counts.
NO_GQA = {**QWEN2_VL_2B, "num_key_value_heads": 12}
SMALL = {**QWEN2_VL_2B, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}


def _scheduler_admits(config: dict, inputs: PlanInputs, max_model_len: int, num_offered: int) -> int:
    """Offer num_offered identical requests; count what the real scheduler admits in one step (prefix cache off)."""
    # the LM shape alone decides KV bytes; parsed as qwen2-vl until the qwen2.5-vl family is registered
    kv_tok = model_config_from_dict({**config, "model_type": "qwen2_vl"}).kv_bytes_per_token(
        4 if inputs.dtype == "float32" else 2)
    cache = CacheConfig(block_size=inputs.block_size, kv_cache_memory_bytes=inputs.kv_cache_memory_bytes,
                        enable_prefix_caching=False)
    num_blocks = cache.kv_cache_memory_bytes // (kv_tok * cache.block_size)
    sched_cfg = SchedulerConfig(max_batched_tokens=10**9, max_num_seqs=10**6, long_step_tokens=10**9,
                                decode_reserve_tokens=inputs.decode_reserve_tokens)
    sched = Scheduler(sched_cfg, cache, num_blocks, max_model_len, encoder_capacity_tokens=0)
    n = inputs.prompt_tokens
    for i in range(num_offered):
        er = EngineRequest(f"r{i}", tuple([7] * n), (), torch.zeros(3, n, dtype=torch.long), 0,
                           SamplingParams(max_tokens=inputs.output_tokens), Timeline())
        sched.add(Request(er, arrival_seq=i))
    sched.schedule()
    sched.check_invariants()
    assert sched.waiting, "the oracle must offer more requests than fit"
    return len(sched.running)


@pytest.mark.parametrize("config", [QWEN25_VL_7B, QWEN2_VL_2B, NO_GQA, SMALL], ids=["7b", "2b", "nogqa", "small"])
@pytest.mark.parametrize(
    "memory, text, images, image_tokens, reserve, block",
    [
        ("24GiB", 800, 3, 1200, 64, 16),  # the seed's workload after the fix
        ("2GiB", 800, 3, 4000, 64, 16),  # the seed's workload before it
        ("1GiB", 850, 0, 0, 64, 16),  # text only
        ("1GiB", 1, 0, 0, 0, 32),  # prompt + reserve well under a block
        ("300MiB", 37, 1, 1369, 15, 8),  # 1024x1024 image at the processor's default budget
    ],
)
def test_max_concurrency_equals_what_the_scheduler_admits(config, memory, text, images, image_tokens, reserve,
                                                           block):
    inputs = PlanInputs(kv_cache_memory_bytes=parse_bytes(memory), peak_concurrency=8, text_tokens=text,
                        images_per_request=images, image_tokens=image_tokens, output_tokens=256,
                        block_size=block, decode_reserve_tokens=reserve)
    plan = make_plan(config, inputs)
    assert plan.max_concurrency == _scheduler_admits(config, inputs, plan.max_model_len, plan.max_concurrency + 3)


def test_max_model_len_caps_the_admission_reserve_like_the_scheduler():
    inputs = PlanInputs(kv_cache_memory_bytes=parse_bytes("64MiB"), peak_concurrency=4, text_tokens=1000,
                        images_per_request=0, decode_reserve_tokens=500, max_model_len=1040)
    plan = make_plan(SMALL, inputs)
    assert plan.admission_blocks_per_request == 65  # ceil(1040 / 16), not ceil((1021 + 500) / 16)
    assert plan.max_concurrency == _scheduler_admits(SMALL, inputs, 1040, plan.max_concurrency + 3)


def test_qwen25_vl_7b_worked_plan():
    inputs = PlanInputs(kv_cache_memory_bytes=parse_bytes("24GiB"), peak_concurrency=32)
    plan = make_plan(QWEN25_VL_7B, inputs)
    assert plan.num_params == 8_292_166_656  # the published Qwen2.5-VL-7B-Instruct count
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert plan.seed_kv_bytes_per_token == 2 * 28 * 28 * 128 * 2
    assert plan.seed_overstatement == 7.0  # 28 attention heads over 4 KV heads
    assert plan.prompt_tokens == 800 + 3 * 1200 + 21 + 3 * 2
    assert plan.admission_blocks_per_request == -(-(plan.prompt_tokens + 64) // 16)
    assert plan.fits and plan.max_concurrency >= 32
    assert plan.serve_flags["--kv-cache-memory"] == "24GiB"
    assert plan.serve_flags["--image-max-tokens"] == "1200"
    # The largest prompt at the peak really admits 32 and one block more does not.
    per_request = plan.num_kv_blocks // 32
    assert -(-(plan.max_prompt_tokens_at_peak + 64) // 16) == per_request


def test_qwen2_vl_2b_params_and_gqa():
    plan = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4))
    assert plan.num_params == 2_208_985_600  # published Qwen2-VL-2B-Instruct count (tied embeddings)
    assert plan.seed_overstatement == 6.0


@pytest.mark.parametrize("layout", ["transformers", "original"])
def test_param_count_matches_a_real_checkpoint(tmp_path, layout):
    from firsttoken.models.checkpoint import make_model

    out = make_model(tmp_path / layout, size="tiny", layout=layout)
    meta = json.loads((out / "firsttoken_checkpoint.json").read_text())
    config = json.loads((out / "config.json").read_text())
    plan = make_plan(config, PlanInputs(kv_cache_memory_bytes=2**30, peak_concurrency=1, dtype="float32"),
                     model_dir=out)
    assert plan.num_params == meta["params"]["total"] == plan.safetensors_params
    assert plan.num_params_vision == meta["params"]["vision"]
    assert plan.safetensors_bytes == plan.weights_bytes  # fp32 on disk, fp32 planned
    assert plan.kv_bytes_per_token == model_config_from_dict(config).kv_bytes_per_token(4)
    assert ModelShape.from_config(config).head_dim == 16


@pytest.mark.parametrize("text, expected", [("24GiB", 24 * 2**30), ("80G", 80 * 10**9), ("80GB", 80 * 10**9),
                                            ("512MiB", 512 * 2**20), ("1073741824", 2**30), ("1.5GiB", 3 * 2**29)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("lots")


def test_cli_prints_table_flags_and_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN25_VL_7B))
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--config", str(cfg), "--memory", "24GiB", "--peak-concurrency", "32", "--json", str(out_json)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "7.0x overstated" in stdout
    assert "firsttoken serve --kv-cache-memory 24GiB" in stdout
    data = json.loads(out_json.read_text())
    assert data["max_concurrency"] == make_plan(QWEN25_VL_7B, PlanInputs(parse_bytes("24GiB"), 32)).max_concurrency
