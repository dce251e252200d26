"""firsttoken plan: its own arithmetic held against the real scheduler (the oracle) and the real checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from firsttoken.cli.main import main
from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig
from firsttoken.engine.resolve import plan_kv_capacity
from firsttoken.models.qwen2_vl_checkpoint import SIZES, build_hf_config
from firsttoken.models.registry import model_config_from_dict
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.scheduler import Scheduler
from firsttoken.tools.plan import (
    DoesNotFit,
    ModelShape,
    PlanInputs,
    UnderOneTile,
    format_plan,
    make_plan,
    parse_bytes,
)
from firsttoken.types import EngineRequest, SamplingParams
from tests.oracle.test_qwen3_vl_config import QWEN3_VL_8B_CONFIG as QWEN3_VL_8B
from tests.published_configs import QWEN2_VL_2B, QWEN25_VL_7B

# A shape without GQA and a tiny one, so the oracle also sees small pools and odd block counts.
NO_GQA = {**QWEN2_VL_2B, "num_key_value_heads": 12}
SMALL = {**QWEN2_VL_2B, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}


def lm_config(config: dict):
    """The serving engine's own parse of the config: its KV bytes per token are what the real pool is sized by."""
    return model_config_from_dict(config)


def _scheduler_admits(config: dict, inputs: PlanInputs, pool_bytes: int, max_model_len: int, num_offered: int) -> int:
    """Offer num_offered identical requests; count what the real scheduler admits in one step (prefix cache off)."""
    kv_tok = lm_config(config).kv_bytes_per_token(4 if inputs.dtype == "float32" else 2)
    cache = CacheConfig(block_size=inputs.block_size, kv_cache_memory_bytes=pool_bytes, enable_prefix_caching=False)
    num_blocks = cache.kv_cache_memory_bytes // (kv_tok * cache.block_size)
    sched_cfg = SchedulerConfig(max_batched_tokens=10**9, max_num_seqs=10**6, long_step_tokens=10**9,
                                decode_reserve_tokens=inputs.decode_reserve_tokens)
    sched = Scheduler(sched_cfg, cache, num_blocks, max_model_len, encoder_capacity_tokens=0)
    n = inputs.prompt_tokens
    for i in range(num_offered):
        er = EngineRequest(f"r{i}", tuple([7] * n), (), torch.zeros(3, n, dtype=torch.long), 0,
                           SamplingParams(max_tokens=inputs.output_tokens), 0.0, 0.0)
        sched.add(Request(er, arrival_seq=i))
    sched.schedule()
    sched.check_invariants()
    assert sched.waiting, "the oracle must offer more requests than fit"
    return len(sched.running)


def _serve_pool_bytes(plan) -> int:
    """What `firsttoken serve` reads from the plan's --kv-cache-memory flag."""
    return parse_bytes(plan.serve_flags["--kv-cache-memory"])


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
    assert _serve_pool_bytes(plan) == inputs.kv_cache_memory_bytes
    assert plan.max_concurrency == _scheduler_admits(config, inputs, _serve_pool_bytes(plan), plan.max_model_len,
                                                     plan.max_concurrency + 3)


@pytest.mark.parametrize(
    "config, device, dtype, text, images, image_tokens",
    [
        (QWEN25_VL_7B, "80GiB", "bfloat16", 800, 3, 1200),  # the H100: weights 15.45 GiB of 72 usable
        (QWEN25_VL_7B, "24GiB", "bfloat16", 800, 3, 1200),  # a 24 GB card: what is left after the weights
        (QWEN3_VL_8B, "48GiB", "bfloat16", 800, 3, 1200),  # Qwen3-VL: head_dim 128 explicit, 16-px patches
        (QWEN2_VL_2B, "16G", "float32", 850, 0, 0),  # text only, fp32, decimal gigabytes
        (NO_GQA, "12GiB", "bfloat16", 37, 1, 1369),
        (SMALL, "6GiB", "float32", 400, 2, 300),
    ],
    ids=["7b-80GiB", "7b-24GiB", "qwen3-8b-48GiB", "2b-16G-fp32", "nogqa-12GiB", "small-6GiB"],
)
def test_device_memory_plan_admits_what_the_scheduler_and_engine_do(config, device, dtype, text, images,
                                                                     image_tokens):
    """--memory is the device: the pool serve gets is what is left, and the engine sizes that pool to the
    plan's blocks, of which the real scheduler admits exactly the plan's max concurrency."""
    inputs = PlanInputs(peak_concurrency=8, device_memory_bytes=parse_bytes(device), dtype=dtype, text_tokens=text,
                        images_per_request=images, image_tokens=image_tokens)
    plan = make_plan(config, inputs)
    m = plan.memory
    usable = int(parse_bytes(device) * 0.9)
    assert m.weights_bytes + m.workspace_bytes + m.encoder_cache_bytes + m.kv_cache_memory_bytes <= usable
    assert usable - m.used_bytes < 2**20  # only the rounding of the pool down to a whole MiB is left over
    engine = EngineConfig(dtype=dtype, cache=CacheConfig(block_size=16, kv_cache_memory_bytes=_serve_pool_bytes(plan)))
    assert plan_kv_capacity(lm_config(config), engine).num_blocks == plan.num_kv_blocks
    assert plan.max_concurrency == _scheduler_admits(config, inputs, _serve_pool_bytes(plan), plan.max_model_len,
                                                     plan.max_concurrency + 3)


def test_80gib_device_is_not_an_80gib_kv_pool():
    """The issue: --memory 80GiB planned an 80 GiB pool (max concurrency 333, 95 GiB in all)."""
    device = PlanInputs(peak_concurrency=32, device_memory_bytes=parse_bytes("80GiB"))
    pool_only = PlanInputs(peak_concurrency=32, kv_cache_memory_bytes=parse_bytes("80GiB"))
    plan, old = make_plan(QWEN25_VL_7B, device), make_plan(QWEN25_VL_7B, pool_only)
    assert old.max_concurrency == 333  # the old reading, still what --kv-cache-memory 80GiB means
    assert plan.memory.used_bytes <= 72 * 2**30 < old.memory.used_bytes
    left = 72 * 2**30 - plan.weights_bytes - plan.memory.workspace_bytes - 512 * 2**20  # 512 MiB encoder cache
    assert plan.kv_cache_memory_bytes == left // 2**20 * 2**20
    assert plan.max_concurrency == plan.num_kv_blocks // plan.admission_blocks_per_request < 333
    assert plan.fits


def test_each_workspace_term_comes_out_of_the_pool():
    """A bigger step budget costs the pool exactly its workspace; no images means no vision-tower term."""
    small = PlanInputs(peak_concurrency=4, device_memory_bytes=parse_bytes("40GiB"), max_batched_tokens=2048)
    big = PlanInputs(peak_concurrency=4, device_memory_bytes=parse_bytes("40GiB"), max_batched_tokens=8192)
    a, b = make_plan(QWEN25_VL_7B, small), make_plan(QWEN25_VL_7B, big)
    assert b.workspace.lm_activation_bytes == 4 * a.workspace.lm_activation_bytes  # linear in step tokens
    grown = b.memory.workspace_bytes - a.memory.workspace_bytes
    assert grown > 0 and abs((a.kv_cache_memory_bytes - b.kv_cache_memory_bytes) - grown) < 2**20
    text_only = make_plan(QWEN25_VL_7B, PlanInputs(peak_concurrency=4, device_memory_bytes=parse_bytes("40GiB"),
                                                   images_per_request=0))
    assert text_only.workspace.vision_activation_bytes == 0 and text_only.workspace.num_image_patches == 0
    assert a.workspace.num_image_patches == 1200 * 4  # 2x2 patches per visual token


@pytest.mark.parametrize("device, term", [("16GiB", "the weights alone need 15.45 GiB"),
                                          ("17.5GiB", r"weights 15.45 GiB \+ step workspace")])
def test_refuses_a_device_that_leaves_no_kv_pool(device, term):
    with pytest.raises(DoesNotFit, match=term):
        make_plan(QWEN25_VL_7B, PlanInputs(peak_concurrency=1, device_memory_bytes=parse_bytes(device)))


def test_max_model_len_caps_the_admission_reserve_like_the_scheduler():
    inputs = PlanInputs(kv_cache_memory_bytes=parse_bytes("64MiB"), peak_concurrency=4, text_tokens=1000,
                        images_per_request=0, decode_reserve_tokens=500, max_model_len=1040)
    plan = make_plan(SMALL, inputs)
    assert plan.admission_blocks_per_request == 65  # ceil(1040 / 16), not ceil((1021 + 500) / 16)
    assert plan.max_concurrency == _scheduler_admits(SMALL, inputs, parse_bytes("64MiB"), 1040,
                                                     plan.max_concurrency + 3)


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


def test_qwen3_vl_8b_worked_plan():
    """Qwen3-VL-8B as published: explicit head_dim 128, 8 KV heads over 36 layers, q/k norms and DeepStack mergers
    counted in the parameters, 16-px patches in the vision workspace."""
    inputs = PlanInputs(kv_cache_memory_bytes=parse_bytes("24GiB"), peak_concurrency=16)
    plan = make_plan(QWEN3_VL_8B, inputs)
    assert plan.num_params == 8_767_123_696  # the published Qwen3-VL-8B-Instruct count
    assert plan.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == lm_config(QWEN3_VL_8B).kv_bytes_per_token(2)
    assert plan.seed_overstatement == 4.0  # 32 attention heads over 8 KV heads
    shape = ModelShape.from_config(QWEN3_VL_8B)
    assert (shape.vision_patch_size, shape.vision_width, shape.vision_mlp_width) == (16, 1152, 4304)
    assert shape.vision_patches(1200) == 4 * 1200  # 2x2 merge: four 16-px patches per visual token
    assert plan.fits and plan.max_concurrency >= 16
    assert plan.max_concurrency == _scheduler_admits(QWEN3_VL_8B, inputs, _serve_pool_bytes(plan), plan.max_model_len,
                                                     plan.max_concurrency + 3)


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


@pytest.mark.parametrize("size, num_params", [("tiny", 2_228_480), ("small", 44_043_776)])
def test_param_count_from_config_matches_make_model_checkpoints(size, num_params):
    """LM + vision tower + lm_head (untied): the counts make-model's checkpoints really hold."""
    config = build_hf_config(SIZES[size]).to_dict()
    plan = make_plan(config, PlanInputs(peak_concurrency=1, kv_cache_memory_bytes=2**30, dtype="float32"))
    assert plan.num_params == num_params
    assert plan.weights_bytes == 4 * num_params


def test_a_missing_config_field_is_named_not_a_bare_key_error():
    vision = {k: v for k, v in QWEN25_VL_7B["vision_config"].items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"^config.json has no vision_config.intermediate_size, needed to size the "
                                         r"vision tower's weights and workspace$"):
        make_plan({**QWEN25_VL_7B, "vision_config": vision}, PlanInputs(peak_concurrency=1, kv_cache_memory_bytes=1))
    text = {k: v for k, v in QWEN2_VL_2B.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="config.json has no num_hidden_layers, needed to count the layers"):
        make_plan(text, PlanInputs(peak_concurrency=1, kv_cache_memory_bytes=1))


def test_cli_prints_table_flags_and_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN25_VL_7B))
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--config", str(cfg), "--kv-cache-memory", "24GiB", "--peak-concurrency", "32",
            "--json", str(out_json)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "7.0x overstated" in stdout
    assert "KV pool (given: --kv-cache-memory)" in stdout
    assert "firsttoken serve --kv-cache-memory 24GiB" in stdout
    data = json.loads(out_json.read_text())
    expected = make_plan(QWEN25_VL_7B, PlanInputs(peak_concurrency=32, kv_cache_memory_bytes=parse_bytes("24GiB")))
    assert data["max_concurrency"] == expected.max_concurrency


def test_cli_device_memory_prints_each_term_and_json_to_stdout(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN25_VL_7B))
    argv = ["plan", "--config", str(cfg), "--memory", "80GiB", "--peak-concurrency", "32"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    lines = [line.strip().split("  ")[0] for line in table.splitlines()]
    terms = ["device memory", "- weights (8,292,166,656 params x 2 B)", "- step workspace = max(LM step, vision tower)",
             "LM activations (2048 tokens)", "LM attention scores (2048 x 4688 context)",
             "logits + probabilities (32 rows, fp32)", "vision tower (1 image of 1200 tokens = 4,800 patches)",
             "- encoder cache (--encoder-cache-memory)", "= KV pool (what is left, whole MiB)"]
    assert [line for line in lines if line in terms] == terms  # each term, in this order
    plan = make_plan(QWEN25_VL_7B, PlanInputs(peak_concurrency=32, device_memory_bytes=parse_bytes("80GiB")))
    assert f"firsttoken serve --kv-cache-memory {plan.serve_flags['--kv-cache-memory']} " in table
    assert main([*argv, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)  # JSON alone on stdout
    assert data["memory"]["device_memory_bytes"] == 80 * 2**30 and data["max_concurrency"] == plan.max_concurrency


def test_fp16_quantization_counts_the_language_models_linear_layers_at_two_bytes():
    f32 = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4,
                                            dtype="float32"))
    fp16 = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4,
                                             dtype="float32", quantization="fp16"))
    embed = 151_936 * 1536  # tied: looked up in float32, and a float16 copy packed as the lm_head
    lm, vision = fp16.num_params_language_model, fp16.num_params_vision
    assert fp16.weights_bytes == 4 * (vision + embed) + 2 * (lm - embed) + 2 * embed
    assert f32.weights_bytes == 4 * (lm + vision) and fp16.weights_bytes < 0.8 * f32.weights_bytes  # tower: fp32
    assert fp16.serve_flags["--quantization"] == "fp16" and "--quantization" not in f32.serve_flags
    with pytest.raises(ValueError, match="float32"):
        PlanInputs(kv_cache_memory_bytes=1, peak_concurrency=1, dtype="bfloat16", quantization="fp16")


def test_bf16_quantization_counts_the_language_models_linear_layers_at_two_bytes():
    fp16 = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4,
                                             dtype="float32", quantization="fp16"))
    bf16 = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4,
                                             dtype="float32", quantization="bf16"))
    assert bf16.weights_bytes == fp16.weights_bytes and bf16.serve_flags["--quantization"] == "bf16"
    assert "LM linear layers x 2 B" in format_plan(bf16)
    with pytest.raises(ValueError, match="float32"):
        PlanInputs(kv_cache_memory_bytes=1, peak_concurrency=1, dtype="bfloat16", quantization="bf16")
    with pytest.raises(DoesNotFit, match="packs them to bfloat16"):
        make_plan(QWEN2_VL_2B, PlanInputs(device_memory_bytes=parse_bytes("6GiB"), peak_concurrency=1,
                                          dtype="float32", quantization="bf16"))


def test_int8_quantization_counts_both_towers_linear_layers_at_one_byte():
    f32 = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4,
                                            dtype="float32"))
    int8 = make_plan(QWEN2_VL_2B, PlanInputs(kv_cache_memory_bytes=parse_bytes("8G"), peak_concurrency=4,
                                             dtype="float32", quantization="int8"))
    embed = 151_936 * 1536  # tied: looked up in float32, and an int8 copy packed as the lm_head
    lm, vision = int8.num_params_language_model, int8.num_params_vision
    assert int8.weights_bytes == 4 * embed + (lm - embed) + embed + vision
    assert int8.weights_bytes < 0.4 * f32.weights_bytes
    assert int8.serve_flags["--quantization"] == "int8"
    assert "LM and vision linear layers x 1 B" in format_plan(int8)
    with pytest.raises(ValueError, match="float32"):
        PlanInputs(kv_cache_memory_bytes=1, peak_concurrency=1, dtype="bfloat16", quantization="int8")
    with pytest.raises(DoesNotFit, match="packs them to int8"):  # 8.8 GB of float32 weights read first
        make_plan(QWEN2_VL_2B, PlanInputs(device_memory_bytes=parse_bytes("6GiB"), peak_concurrency=1,
                                          dtype="float32", quantization="int8"))


def test_fp16_plans_for_the_float32_load_peak():
    # 2B: 8.8 GB of float32 weights, 6.7 GB once packed; 9 GiB x 0.9 holds the second, not the first
    with pytest.raises(DoesNotFit, match="loading reads the float32 weights first"):
        make_plan(QWEN2_VL_2B, PlanInputs(device_memory_bytes=parse_bytes("9GiB"), peak_concurrency=1,
                                          dtype="float32", quantization="fp16"))


def test_videos_count_in_the_prompt_the_vision_item_and_the_flags():
    from firsttoken.config import VideoConfig
    from firsttoken.tools.plan import video_tokens_at_most

    base = PlanInputs(peak_concurrency=8, kv_cache_memory_bytes=parse_bytes("24GiB"), images_per_request=1)
    video = PlanInputs(**{**base.__dict__, "videos_per_request": 1})
    assert video.video_tokens == VideoConfig().video_max_tokens == 4096  # serve's cap is the default
    assert video.prompt_tokens == base.prompt_tokens + 4096 + 2  # its tokens and <|vision_start|><|vision_end|>
    plain, with_video = make_plan(QWEN25_VL_7B, base), make_plan(QWEN25_VL_7B, video)
    assert with_video.admission_blocks_per_request > plain.admission_blocks_per_request
    assert with_video.max_concurrency < plain.max_concurrency
    assert with_video.serve_flags["--video-max-tokens"] == "4096" and "--video-max-tokens" not in plain.serve_flags
    assert "+ 1 x 4096 video +" in format_plan(with_video)
    # the tower runs one two-frame grid at a time: a video alone needs a grid's workspace, not 4096 tokens'
    alone = PlanInputs(**{**video.__dict__, "images_per_request": 0})
    assert alone.vision_item_tokens == 768
    # a clip's tokens at most: 2 fps, at least 4 frames, two-frame grids of at most 768, within the budget
    assert [video_tokens_at_most(s) for s in (1, 3, 4, 60)] == [1536, 2304, 3072, 4096]


def test_cli_plans_video_seconds_within_the_video_budget(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN25_VL_7B))
    argv = ["plan", "--config", str(cfg), "--kv-cache-memory", "24GiB", "--peak-concurrency", "8",
            "--images-per-request", "0", "--videos-per-request", "2", "--json", "-"]
    assert main([*argv, "--video-seconds", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["video_tokens"] == 2304 and data["prompt_tokens"] == 800 + 2 * 2304 + 21 + 4
    assert main([*argv, "--video-seconds", "3", "--video-tokens", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["serve_flags"]["--video-max-tokens"] == "1000"
    assert main([*argv, "--video-tokens", "50"]) == 2
    assert "--video-tokens 50: must be >= video_min_frame_tokens" in capsys.readouterr().err


def test_a_tiling_family_is_planned_at_the_rung_its_budget_buys_and_says_how_many_tiles():
    """An operator planning InternVL with the seed's 1,200-token budget: each image is at most 3 crops and the
    thumbnail (1,024 tokens), not 1,200; the plan says so and counts its KV and prompt limit from it, while the
    serve command keeps the budget the operator asked for."""
    from firsttoken.models.internvl_checkpoint import SIZES, build_hf_config
    from firsttoken.tools.plan import format_plan

    config = build_hf_config(SIZES["small"]).to_dict()
    inputs = PlanInputs(peak_concurrency=8, kv_cache_memory_bytes=1 << 30, text_tokens=800, images_per_request=3,
                        image_tokens=1200, template_overhead_tokens=27)
    plan = make_plan(config, inputs)
    assert (plan.inputs.image_item_tokens, plan.inputs.image_tiles) == (1024, 4)
    assert plan.prompt_tokens == 800 + 3 * 1024 + 27
    assert plan.serve_flags["--image-max-tokens"] == "1200"
    assert "3 x 1024 image (4 tiles at most under 1200)" in format_plan(plan)
    one_tile = make_plan(config, PlanInputs(peak_concurrency=8, kv_cache_memory_bytes=1 << 30, image_tokens=700))
    assert (one_tile.inputs.image_item_tokens, one_tile.inputs.image_tiles) == (256, 1)
    qwen = make_plan(QWEN25_VL_7B, inputs)
    assert (qwen.inputs.image_item_tokens, qwen.inputs.image_tiles) == (1200, None)
    with pytest.raises(UnderOneTile):  # serve refuses a budget under one tile: so does the plan
        make_plan(config, PlanInputs(peak_concurrency=8, kv_cache_memory_bytes=1 << 30, image_tokens=200))


def test_a_tiling_checkpoint_s_own_max_patches_caps_the_plan(tmp_path) -> None:
    """A checkpoint whose processor allows 6 crops: the family's default budget buys 6 crops and the thumbnail
    (1,792 tokens), not the release's 12."""
    from firsttoken.models.internvl_checkpoint import (
        SIZES,
        build_hf_config,
        preprocessor_dict,
    )

    config = build_hf_config(SIZES["tiny"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**preprocessor_dict(), "max_patches": 6}))
    plan = make_plan(config, PlanInputs(peak_concurrency=1, kv_cache_memory_bytes=1 << 30, image_tokens=3328),
                     model_dir=tmp_path)
    assert (plan.inputs.image_item_tokens, plan.inputs.image_tiles) == (1792, 7)
