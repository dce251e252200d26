"""The profiling step of start-up on a device: one forward at the largest step the budgets allow,
run once after the weights are loaded and before the KV pool exists, so that
device_memory.measure_device_memory sees its peak (vLLM's ``profile_run``). Nothing of it is kept:
its image's embeddings, its scratch KV blocks and its logits are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.config import EngineConfig
from firsttoken.models.interfaces import ImageRows
from firsttoken.models.model_config import ModelConfig
from firsttoken.runner.kv_cache import allocate_kv_caches


@dataclass(frozen=True)
class ProfileStep:
    """The largest step the budgets allow.

    num_tokens: prefill tokens in one forward: --max-batched-tokens, at most the context length.
    image_tokens: visual tokens of the one image the vision tower encodes first (the largest the
    image budget
        allows: --image-max-tokens, rounded down to a whole grid); 0: no image.
    num_sampled_rows: rows whose logits are computed: --max-num-seqs (a decode step samples every
    row), at most
        num_tokens.
    """

    num_tokens: int
    image_tokens: int
    num_sampled_rows: int

    @staticmethod
    def of(config: EngineConfig, model: ModelConfig, image_tokens: int) -> "ProfileStep":
        context_len = config.scheduler.max_model_len or model.max_position_embeddings
        num_tokens = min(config.scheduler.max_batched_tokens, context_len)
        return ProfileStep(num_tokens, image_tokens, min(config.scheduler.max_num_seqs, num_tokens))

    def image_grid(self, model: ModelConfig) -> tuple[int, int, int]:
        """(t, h, w) in patches of the image: near square (or whole tiles), ``image_tokens`` at
        most after the merge."""
        return model.image_processor.grid_for(self.image_tokens)


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, config: ModelConfig, step: ProfileStep, block_size: int,
                    device: torch.device | str) -> None:
    """The vision tower over one image at the budget, then one prefill forward of
    ``step.num_tokens`` tokens (the image's rows placed over its first rows) writing into a scratch
    KV pool of just those tokens' blocks, then the logits of ``step.num_sampled_rows`` rows. The
    scratch pool counts in the measured peak (a conservative overcount of num_tokens x KV bytes per
    token)."""
    gen = torch.Generator().manual_seed(0)
    images: list[ImageRows] = []
    if step.image_tokens > 0:
        grid = step.image_grid(config)
        p = config.image_processor
        pixels = torch.randn(
            (grid[0] * grid[1] * grid[2], 3 * p.temporal_patch_size * p.patch_size**2),
            generator=gen,
        )  # [patches, C*T*P*P]
        embeddings = model.visual(pixels.to(device, model.dtype), [grid])
        rows = min(embeddings.num_tokens, step.num_tokens)
        images.append(ImageRows(0, embeddings.rows(0, rows)))
    n = step.num_tokens
    num_blocks = -(-n // block_size)
    kv_caches = allocate_kv_caches(config, num_blocks, block_size, model.dtype, device)
    meta = AttentionMetadata.build([n], [0], [list(range(num_blocks))], block_size, device)
    input_ids = torch.zeros(n, dtype=torch.long, device=device)
    # [3, n] (t, h, w), one row seen as three
    positions = torch.arange(n, device=device).expand(3, -1)
    out = model.forward_step(input_ids, positions, kv_caches, meta, images)
    # [num_sampled_rows, vocab] float32
    model.compute_logits(out.hidden[n - step.num_sampled_rows:])
