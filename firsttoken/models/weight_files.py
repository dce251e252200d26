"""A checkpoint's safetensors files, and what their headers say without reading any tensor."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards, else model.safetensors, else every
    *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return [model_dir / name for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return files


def stored_linear_dtypes(model_dir: Path) -> set[str]:
    """The safetensors dtypes ("BF16", "F32", ...) of the checkpoint's language-model projection
    weights (every ``*_proj.weight`` outside the vision tower, and the lm_head), read from the
    files' headers."""
    dtypes: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if "visual" not in key and (
                    key.endswith("_proj.weight") or key.endswith("lm_head.weight")
                ):
                    dtypes.add(f.get_slice(key).get_dtype())
    return dtypes
