"""Published models' config.json values (the fields firsttoken reads), for tests that check shapes without the
weights: tests/unit/test_plan.py (the planner), tests/engine/test_device.py and tests/gpu (--load-format dummy).
Kept apart from any test module so importing them imports nothing else (a GPU machine's older transformers
included)."""

from __future__ import annotations

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

# config.json as released, every field (transformers reads more of them than firsttoken does: rope_theta,
# rms_norm_eps, ...), for building transformers' model beside ours on the same shape (benchmarks/gpu).
QWEN2_VL_7B_INSTRUCT = {  # Qwen/Qwen2-VL-7B-Instruct
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064,
}
QWEN25_VL_7B_INSTRUCT = {  # Qwen/Qwen2.5-VL-7B-Instruct (the "original" layout)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064,
}
