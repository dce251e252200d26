"""Load a Qwen2-VL checkpoint (safetensors, single file or sharded) into our model.

Two checkpoint naming layouts are accepted (transformers 5.24's ``save_pretrained`` writes the first):
- original Qwen release: ``model.embed_tokens``, ``model.layers.N.*``, ``model.norm``, ``lm_head``, ``visual.*``;
- transformers 4.5x-style: ``model.language_model.*``, ``model.visual.*``, ``lm_head``.
Tensors are read one at a time and cast straight to the target dtype, so a bf16 load never holds an fp32 copy
of the model. q/k/v and gate/up are stacked into our fused projections; the Conv3d patch-embedding weight is
flattened for our Linear.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from firsttoken.attention.base import AttentionBackend
from firsttoken.attention.registry import get_backend
from firsttoken.config import ModelConfig
from firsttoken.models.registry import model_class_for_config

# checkpoint prefix -> our prefix, first match wins (longest prefixes first)
_PREFIXES = (
    ("model.language_model.", ""),
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.", ""),
    ("lm_head.", "lm_head."),
)
# checkpoint sub-name -> (our fused sub-name, part index); parts are concatenated along dim 0 in index order
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_STACKED_RE = re.compile(r"^(layers\.\d+\.)(" + "|".join(re.escape(k) for k in _STACKED) + r")\.(weight|bias)$")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend | None = None,
):
    """A Qwen2VLModel in eval mode with weights from model_dir; attn_backend defaults to "sdpa"."""
    model_dir = Path(model_dir)
    with open(model_dir / "config.json") as f:
        config_json = json.load(f)
    model_cls = model_class_for_config(config_json)
    config = ModelConfig.from_dict(config_json)
    with torch.device("meta"):
        model = model_cls(config, attn_backend or get_backend("sdpa"))
    expected = {name: p.shape for name, p in model.named_parameters()}

    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    unexpected: list[str] = []
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _our_name(key)
                if name is None:
                    unexpected.append(key)
                    continue
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name.startswith("lm_head.") and config.tie_word_embeddings:
                    continue  # tied: the reference uses embed_tokens
                stacked = _STACKED_RE.match(name)
                tensor = f.get_tensor(key).to(device=device, dtype=dtype)
                if stacked:
                    fused, index = _STACKED[stacked.group(2)]
                    parts.setdefault(f"{stacked.group(1)}{fused}.{stacked.group(3)}", {})[index] = tensor
                elif name == "visual.patch_embed.proj.weight":
                    state[name] = tensor.reshape(tensor.shape[0], -1)  # Conv3d [E, C, T, P, P] -> Linear [E, C*T*P*P]
                elif name in expected:
                    state[name] = tensor
                else:
                    unexpected.append(key)
    for name, by_index in parts.items():
        num_parts = 3 if "qkv_proj" in name else 2
        if sorted(by_index) == list(range(num_parts)):
            state[name] = torch.cat([by_index[i] for i in range(num_parts)], dim=0)

    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match {model_cls.__name__}: "
            f"missing {len(missing)} {missing[:8]}, unexpected {len(unexpected)} {unexpected[:8]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name]:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(expected[name])}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _safetensors_files(model_dir: Path) -> list[Path]:
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


def _our_name(key: str) -> str | None:
    for prefix, ours in _PREFIXES:
        if key.startswith(prefix):
            return ours + key[len(prefix) :]
    return None
