"""The physical KV cache: one tensor per decoder layer, laid out as the attention contract says."""

from __future__ import annotations

import torch

from firsttoken.models.model_config import ModelConfig


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Per layer a zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor (0 = K, 1 = V).

    Zeroed, not empty: padded reads (batched decode) then see finite values that the mask weights by
    0.
    """
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
