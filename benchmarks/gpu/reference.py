"""transformers' model of a checkpoint's family over our engine's weights, sharing their memory.

A device run has no weights on disk (a 7B checkpoint is 15 GB in bf16, 30 GB in fp32) and no room for a second
copy of them beside ours in fp32, so transformers' model is built on the device with its own random init, in bf16
whatever the dtype compared (the init's parameters are dropped at once: the smallest passing copy), and then given
views of our tensors in its own names (``WeightMapping.checkpoint_views``: q/k/v and gate/up are row slices of our
fused projections, the patch embedding our Linear weight seen as its Conv3d), which keep our dtype. Both models
then compute with the very same numbers; nothing is copied. Its attention is SDPA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from firsttoken.models.registry import family_of
from firsttoken.types import EngineRequest


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def transformers_over(model_dir: Path, ours: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """transformers' ``...ForConditionalGeneration`` for ``model_dir``'s config, in eval mode, every parameter a
    view of ``ours``' (a tied lm_head: of our embeddings). ValueError naming any parameter without a counterpart."""
    family = family_of(model_dir)
    config = AutoConfig.from_pretrained(model_dir, attn_implementation="sdpa")
    model_class = family.checkpoint.hf_model_class()
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in model_class(config).state_dict().items()}
    state = dict(ours.state_dict())
    views, unmatched = family.weights.checkpoint_views(shapes, state)
    if "lm_head.weight" in unmatched and "embed_tokens.weight" in state:  # tied: the head reads the embeddings
        views["lm_head.weight"] = state["embed_tokens.weight"]
        unmatched.remove("lm_head.weight")
    if unmatched:
        raise ValueError(f"transformers' {model_class.__name__} has parameters with no counterpart in ours: "
                         f"{unmatched[:8]}")
    with torch.device(device), default_dtype(torch.bfloat16):
        reference = model_class(config)  # its own init, replaced next (buffers such as rotary tables stay its own)
    reference.load_state_dict(views, strict=True, assign=True)
    # the init's dtype must not survive anywhere the comparison reads: parameters are ours, float buffers fp32
    stray = [name for name, t in (*reference.named_parameters(), *reference.named_buffers())
             if t.is_floating_point() and t.dtype not in (dtype, torch.float32)]
    if stray:
        raise ValueError(f"transformers' {model_class.__name__} keeps {len(stray)} tensors in its init dtype: "
                         f"{stray[:4]}")
    return reference.eval()


def model_inputs(request: EngineRequest, dtype: torch.dtype, device: str,
                 extra_ids: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:  # fmt: skip
    """transformers' forward/generate inputs for our processed request (the very ids and patches our engine got),
    followed by ``extra_ids`` (teacher forcing). The image token id is the checkpoint's (our config's)."""
    ids = torch.tensor([[*request.prompt_token_ids, *extra_ids]], device=device)
    inputs = {"input_ids": ids}
    images = [im for im in request.images if im.kind == "image"]
    if images:
        pad = request.prompt_token_ids[images[0].offset]
        inputs |= {"pixel_values": torch.cat([im.pixel_values for im in images]).to(device=device, dtype=dtype),
                   "image_grid_thw": torch.tensor([im.grid_thw for im in images], device=device),
                   "mm_token_type_ids": (ids == pad).long()}  # fmt: skip
    return inputs
