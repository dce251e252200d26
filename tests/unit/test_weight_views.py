"""``WeightMapping.checkpoint_views``, the inverse of loading: our model's weights seen in the checkpoint's names
and shapes, sharing memory (the GPU table builds transformers' model over our 7B weights that way). For every
family, the views of a model loaded from a checkpoint hold that checkpoint's tensors exactly, and loading the views
again gives back our state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from firsttoken.loading.loader import load_model
from firsttoken.models.checkpoint import make_model, recipes
from firsttoken.models.registry import family_of


@pytest.mark.parametrize("family", sorted(recipes()))
def test_checkpoint_views_are_the_checkpoints_tensors_in_our_memory(family: str, tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / family, size="tiny", seed=3, family=family)
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    ours = dict(load_model(model_dir, torch.float32, cpu_kernels="off").state_dict())
    mapping = family_of(model_dir).weights
    views, unmatched = mapping.checkpoint_views({k: t.shape for k, t in checkpoint.items()}, ours)
    assert unmatched == []
    assert views.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(views[name], tensor), name
    storages = {t.untyped_storage().data_ptr() for t in ours.values()}
    assert all(v.untyped_storage().data_ptr() in storages for v in views.values())  # views, not copies
    state, unexpected = mapping.load_state(((k, lambda v=v: v) for k, v in views.items()),
                                           {k: t.shape for k, t in ours.items()})  # fmt: skip
    assert unexpected == [] and state.keys() == ours.keys()
    assert all(torch.equal(state[k], ours[k]) for k in ours)
