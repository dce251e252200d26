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


# OpenGVLab/InternVL3_5-1B-HF: InternViT-300M (448 px, LayerNorm, no QK norm, mean pooling) + the pixel-shuffle MLP
# projector + Qwen3-0.6B's language model, lm_head untied. Reconstructed from those published components (the -HF
# config.json cannot be fetched from this machine); its parameters on the meta device, in transformers'
# InternVLForConditionalGeneration and in ours, are exactly those recorded for revision
# 9191dbccf312b537016f041b25d61c72e7c5c9f3 of the release: 1,060,897,792 = 304,012,288 vision + 5,253,120 projector
# + 751,632,384 language (a third party's notes, found in stored public GitHub text). image_token_id is
# <IMG_CONTEXT>'s id in Qwen3's tokenizer as the -HF releases extend it.
INTERNVL35_1B_PARAMS = (304_012_288, 5_253_120, 751_632_384)
INTERNVL35_1B_HF = {
    "architectures": ["InternVLForConditionalGeneration"], "model_type": "internvl", "downsample_ratio": 0.5,
    "image_seq_length": 256, "image_token_id": 151671, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "text_config": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "torch_dtype": "bfloat16"},
    "vision_config": {
        "model_type": "internvl_vision", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "image_size": [448, 448], "patch_size": [14, 14], "num_channels": 3,
        "hidden_act": "gelu", "norm_type": "layer_norm", "layer_norm_eps": 1e-06, "use_qk_norm": False,
        "use_absolute_position_embeddings": True, "attention_bias": True, "layer_scale_init_value": 0.1,
        "use_mean_pooling": True},
}
