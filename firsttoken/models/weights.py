"""How a family's checkpoint names map onto its module's parameters, declared as data by the family.

``WeightMapping`` says: which checkpoint prefixes become which of ours (first match wins, so list
longer prefixes first), which names inside them are spelled differently (a family reusing another's
module under the checkpoint's own names), which checkpoint projections are stacked into one fused
parameter of ours (q/k/v into qkv_proj, gate/up into gate_up_proj), which tensors are reshaped (a
Conv3d patch embedding held as a Linear), and which checkpoint tensors carry no parameter (rotary
tables). ``load_state`` turns a stream of (name, tensor) into a state dict for the model, naming
every mismatch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stacked:
    """Checkpoint ``<path>.<part>.(weight|bias)`` is part ``index`` of ours
    ``<path>.<fused>.(weight|bias)``, concatenated along dim 0 in index order."""

    part: str  # e.g. "self_attn.q_proj"
    fused: str  # e.g. "self_attn.qkv_proj"
    index: int
    num_parts: int


@dataclass(frozen=True)
class WeightMapping:
    prefixes: tuple[tuple[str, str], ...]  # (checkpoint prefix, our prefix)
    stacked: tuple[Stacked, ...] = ()
    reshape: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...] = ()  # (our name, fn)
    skip_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # (regex, replacement) applied in order to every name after its prefix is mapped, e.g.
    # Qwen3-VL's "visual.blocks.0.mlp.linear_fc1.weight" -> our "visual.blocks.0.mlp.fc1.weight"
    renames: tuple[tuple[str, str], ...] = ()

    def our_name(self, key: str) -> str | None:
        for prefix, ours in self.prefixes:
            if key.startswith(prefix):
                name = ours + key[len(prefix) :]
                for pattern, replacement in self.renames:
                    name = re.sub(pattern, replacement, name)
                return name
        return None

    def _stacked_pattern(self) -> re.Pattern[str] | None:
        """Our name of a stacked part: (path, part, weight|bias) groups; None without stacked
        parts."""
        if not self.stacked:
            return None
        return re.compile(
            r"^(.*?)(" + "|".join(re.escape(s.part) for s in self.stacked) + r")\.(weight|bias)$"
        )

    def load_state(
        self,
        tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
        expected: dict[str, torch.Size],
        drop: Callable[[str], bool] = lambda name: False,
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(state dict, unexpected checkpoint keys). ``tensors`` yields names with a loader so
        skipped tensors are never read; ``drop(our_name)`` skips parameters the model does not have
        (e.g. a tied lm_head)."""
        stacked_re = self._stacked_pattern()
        by_part = {s.part: s for s in self.stacked}
        reshape = dict(self.reshape)
        state: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[int, torch.Tensor]] = {}
        num_parts: dict[str, int] = {}
        unexpected: list[str] = []
        for key, load in tensors:
            name = self.our_name(key)
            if name is None:
                unexpected.append(key)
                continue
            if name.endswith(self.skip_suffixes) or drop(name):
                continue
            match = stacked_re.match(name) if stacked_re else None
            if match and match.group(2) in by_part:
                s = by_part[match.group(2)]
                fused = f"{match.group(1)}{s.fused}.{match.group(3)}"
                parts.setdefault(fused, {})[s.index] = load()
                num_parts[fused] = s.num_parts
            elif name in expected:
                tensor = load()
                state[name] = reshape[name](tensor) if name in reshape else tensor
            else:
                unexpected.append(key)
        for name, by_index in parts.items():
            if sorted(by_index) == list(range(num_parts[name])):
                state[name] = torch.cat([by_index[i] for i in range(num_parts[name])], dim=0)
        return state, unexpected

    def checkpoint_views(
        self, checkpoint_shapes: Mapping[str, torch.Size], ours: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """``load_state``'s inverse without a copy: (checkpoint name -> a view of our tensor,
        checkpoint names with no counterpart in ``ours``). A stacked part is its rows of our fused
        tensor (the parts' row counts read from ``checkpoint_shapes``, in index order); a reshaped
        tensor is ours viewed in the checkpoint's shape. Names are mapped forward (``our_name``), so
        renames need no inverse. Skipped names (rotary tables) and the names of a tied lm_head come
        back unmatched: the caller decides what they hold."""
        by_part = {s.part: s for s in self.stacked}
        stacked_re = self._stacked_pattern()
        fused_of: dict[str, tuple[str, int]] = {}  # checkpoint name -> (our fused name, part index)
        rows: dict[str, dict[int, int]] = {}  # our fused name -> part index -> its rows
        views: dict[str, torch.Tensor] = {}
        unmatched: list[str] = []
        for key, shape in checkpoint_shapes.items():
            name = self.our_name(key)
            match = stacked_re.match(name) if stacked_re and name is not None else None
            if match and match.group(2) in by_part:
                s = by_part[match.group(2)]
                fused = f"{match.group(1)}{s.fused}.{match.group(3)}"
                fused_of[key] = (fused, s.index)
                rows.setdefault(fused, {})[s.index] = shape[0]
            elif name is not None and name in ours and ours[name].numel() == math.prod(shape):
                views[key] = ours[name].view(shape)
            else:
                unmatched.append(key)
        for key, (fused, index) in fused_of.items():
            if fused not in ours:
                unmatched.append(key)
                continue
            start = sum(n for i, n in rows[fused].items() if i < index)
            views[key] = (
                ours[fused].narrow(0, start, rows[fused][index]).view(checkpoint_shapes[key])
            )
        return views, unmatched


def flatten_conv3d(weight: torch.Tensor) -> torch.Tensor:
    """Conv3d [E, C, T, P, P] (kernel == stride) -> Linear [E, C*T*P*P]: one matmul per flattened
    patch."""
    return weight.reshape(weight.shape[0], -1)


QKV_AND_GATE_UP = (
    Stacked("self_attn.q_proj", "self_attn.qkv_proj", 0, 3),
    Stacked("self_attn.k_proj", "self_attn.qkv_proj", 1, 3),
    Stacked("self_attn.v_proj", "self_attn.qkv_proj", 2, 3),
    Stacked("mlp.gate_proj", "mlp.gate_up_proj", 0, 2),
    Stacked("mlp.up_proj", "mlp.gate_up_proj", 1, 2),
)
